"""The archive: workers move data to Parquet, reads fall through to it unchanged.

Each test archives with a worker on the session Redis (hot window 0 unless
said otherwise) and compares what clients read before and after, byte for
byte and header for header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import pyarrow.parquet as pq
import pytest
import redis.asyncio as aioredis

from gateway.archive.cold import ColdReader
from gateway.archive.files import Archive
from gateway.archive.schema import Row, to_table
from gateway.archive.segments import Segment, file_name
from gateway.http.context import GATEWAY
from gateway.protocol import offsets
from gateway.redis_io import keys
from gateway.streams import reads
from workers.archiver import Archiver, Policy

from .conftest import free_port, ready_worker, start_gateway

# Every round due at once (max delay 0); files below min_bytes are merged with the next
# round (min_bytes 0 would merge nothing). Tiny row groups: cold reads cross row groups as well as files.
HOT0 = Policy(
    hot_bytes=0, hot_ms=0, min_bytes=1 << 20, max_delay_ms=0, file_bytes=1 << 20, row_group_bytes=40
)
READ_HEADERS = ("Stream-Next-Offset", "Stream-Up-To-Date", "Stream-Closed", "Content-Type", "ETag")


@pytest.fixture
def archiver(redis: aioredis.Redis, archive_dir: str) -> Archiver:
    return Archiver(redis, Archive(archive_dir), HOT0)


def sid_of(url: str) -> str:
    return keys.stream_id(url.split("/v1/stream/", 1)[1])


async def transcript(http: aiohttp.ClientSession, url: str, start: str = "-1") -> list[tuple]:
    """Every catch-up response from ``start`` to the tail: status, body, headers."""
    out, offset = [], start
    for _ in range(1000):
        async with http.get(url, params={"offset": offset}) as r:
            body = await r.read()
            out.append((offset, r.status, body, *(r.headers.get(h) for h in READ_HEADERS)))
            if r.status != 200 or r.headers.get("Stream-Up-To-Date") == "true":
                return out
            offset = r.headers["Stream-Next-Offset"]
    raise AssertionError("no end")


async def every_offset(http: aiohttp.ClientSession, url: str, tail: int) -> list[tuple]:
    """A read from every byte position (offsets inside an append included)."""
    out = []
    for pos in range(tail + 1):
        async with http.get(url, params={"offset": offsets.encode(pos)}) as r:
            out.append((pos, r.status, await r.read(), *(r.headers.get(h) for h in READ_HEADERS)))
    return out


async def create(http: aiohttp.ClientSession, url: str, content_type: str, *bodies: bytes) -> None:
    async with http.put(url, headers={"Content-Type": content_type}) as r:
        assert r.status == 201
    for body in bodies:
        async with http.post(url, data=body, headers={"Content-Type": content_type}) as r:
            assert r.status in (200, 204), await r.text()


async def log_length(redis: aioredis.Redis, url: str) -> int:
    return await redis.xlen(keys.stream_keys(sid_of(url))[1])


async def segments_of(redis: aioredis.Redis, url: str, score: str = "0") -> list[Segment]:
    meta = await redis.hgetall(keys.stream_keys(sid_of(url))[0])
    inc = meta[b"inc"].decode()
    members = await redis.zrangebyscore(keys.segments(sid_of(url), inc), score, "+inf")
    return [Segment.parse(m) for m in members]


BYTES = [b"hello ", b"w", b"orld, " * 7, bytes(range(256)) * 2, b"!"]
JSON_BODIES = [b'{"a": 1}', b'[{"b": 2}, {"c": "x"}, 3]', b'"' + b"y" * 100 + b'"', b"[4, 5]"]


@pytest.mark.parametrize(
    "content_type,bodies",
    [
        ("application/octet-stream", BYTES),
        ("text/plain; charset=utf-8", BYTES[:3]),
        ("application/json", JSON_BODIES),
    ],
)
async def test_cold_reads_are_hot_reads(http, url, redis, archiver, content_type, bodies):
    await create(http, url, content_type, *bodies)
    hot = await transcript(http, url)
    async with http.head(url) as r:
        tail = offsets.decode(r.headers["Stream-Next-Offset"])
    hot_every = await every_offset(http, url, tail)
    assert await log_length(redis, url) > 0

    # Part archived (the boundary falls between reads), then all of it.
    half = dataclasses.replace(HOT0, hot_bytes=tail // 2)
    await Archiver(redis, archiver.archive, half).archive_stream(sid_of(url))
    assert 0 < await log_length(redis, url) < len(bodies) + 3
    assert await transcript(http, url) == hot
    assert await every_offset(http, url, tail) == hot_every

    await archiver.archive_stream(sid_of(url))
    assert await log_length(redis, url) == 0
    assert await transcript(http, url) == hot
    assert await every_offset(http, url, tail) == hot_every

    # Appends go on after archiving; reads cross the boundary the same way.
    async with http.post(url, data=bodies[0], headers={"Content-Type": content_type}) as r:
        assert r.status in (200, 204)
    again = await transcript(http, url)
    assert again[: len(hot) - 1] == hot[:-1] and again[-1][1] == 200


async def test_merged_files_and_schema(http, url, redis, archiver, archive_dir):
    """Small archive passes of one stream merge into one file; rows carry the documented schema."""
    await create(http, url, "application/json")
    producer = {"Producer-Id": "p1", "Producer-Epoch": "0"}
    for seq in range(5):
        headers = {"Content-Type": "application/json", **producer, "Producer-Seq": str(seq)}
        async with http.post(url, data=json.dumps([{"n": seq}, {"m": seq}]), headers=headers) as r:
            assert r.status == 200
        await archiver.archive_stream(sid_of(url))
    hot_path_reads = await transcript(http, url)
    (segment,) = await segments_of(redis, url)
    assert await segments_of(redis, url, "-inf") == [segment]  # no staged or garbage files left
    table = pq.read_table(Path(archive_dir) / segment.file).to_pylist()
    assert [row["text"] for row in table] == [
        json.dumps({k: n}, separators=(",", ":")) for n in range(5) for k in "nm"
    ]
    assert [row["producer_seq"] for row in table] == [n for n in range(5) for _ in "nm"]
    assert {row["producer_id"] for row in table} == {"p1"} and {row["producer_epoch"] for row in table} == {0}
    assert {row["stream"] for row in table} == {keys.path_of(sid_of(url))}
    assert table[0]["offset"] == offsets.encode(0) and table[1]["offset"] == table[0]["next_offset"]
    assert [row["data"] for row in table] == [row["text"].encode() for row in table]
    assert segment.file.startswith(f"date={time.strftime('%Y-%m-%d', time.gmtime())}/bucket=")
    assert hot_path_reads[0][2] == b"[" + b",".join(r["data"] for r in table) + b"]"


async def test_forks_read_archived_ancestors(http, url, redis, archiver):
    await create(http, url, "text/plain", b"one two ", b"three four ", b"five")
    fork = url + "-fork"
    source = "/v1/stream/" + url.split("/v1/stream/", 1)[1]
    headers = {
        "Stream-Forked-From": source,
        "Stream-Fork-Offset": offsets.encode(10),
        "Content-Type": "text/plain",
    }
    async with http.put(fork, headers=headers) as r:
        assert r.status == 201, await r.text()
    async with http.post(fork, data=b" six", headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 204
    before = await transcript(http, fork)
    assert b"".join(t[2] for t in before) == b"one two th six"
    for stream in (url, fork):
        await archiver.archive_stream(sid_of(stream))
        assert await log_length(redis, stream) == 0
    assert await transcript(http, fork) == before


async def test_live_reads_start_in_the_archive(http, url, redis, archiver):
    await create(http, url, "text/plain", b"cold ", b"data ")
    await archiver.archive_stream(sid_of(url))
    async with http.get(url, params={"offset": "-1", "live": "long-poll"}) as r:
        assert r.status == 200 and await r.read() == b"cold data "
    async with http.get(url, params={"offset": offsets.encode(2), "live": "sse"}) as r:
        events = ""
        async for line in r.content:
            events += line.decode()
            if "upToDate" in events:
                break
        assert "data:ld data \n" in events
        # A live append arrives on the same SSE connection.
        async with http.post(url, data=b"hot", headers={"Content-Type": "text/plain"}) as w:
            assert w.status == 204
        async for line in r.content:
            events += line.decode()
            if "data:hot" in events:
                break


async def test_delete_and_expiry_remove_the_files(http, url, redis, archiver, archive_dir):
    await create(http, url, "text/plain", b"to be deleted")
    await archiver.archive_stream(sid_of(url))
    (segment,) = await segments_of(redis, url)
    assert (Path(archive_dir) / segment.file).exists()
    async with http.delete(url) as r:
        assert r.status == 204
    await create(http, url, "text/plain")  # the same path again: a new stream, nothing old in it
    async with http.get(url, params={"offset": "-1"}) as r:
        assert r.status == 200 and await r.read() == b""
    await archiver.reconcile(force=True)
    assert not (Path(archive_dir) / segment.file).exists()
    assert not [k async for k in redis.scan_iter(match=keys.segments(sid_of(url), "*"))]

    expiring = url + "-ttl"
    async with http.put(expiring, headers={"Content-Type": "text/plain", "Stream-TTL": "1"}) as r:
        assert r.status == 201
    async with http.post(expiring, data=b"short-lived", headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 204
    await archiver.archive_stream(sid_of(expiring))
    (segment,) = await segments_of(redis, expiring)
    await asyncio.sleep(1.2)  # Redis expires the stream's keys by itself
    await archiver.reconcile(force=True)
    assert not (Path(archive_dir) / segment.file).exists()


async def test_retention_drops_old_data_with_410(http, url, redis, archive_dir):
    policy = dataclasses.replace(HOT0, retention_ms=500)
    archiver = Archiver(redis, Archive(archive_dir), policy)
    await create(http, url, "text/plain", b"old data ")
    await archiver.archive_stream(sid_of(url))
    (old,) = await segments_of(redis, url)
    await asyncio.sleep(0.7)
    async with http.post(url, data=b"new", headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 204
    await archiver.archive_stream(sid_of(url))  # the old file is dropped, the new one kept
    assert not (Path(archive_dir) / old.file).exists()
    async with http.get(url, params={"offset": offsets.encode(0)}) as r:
        assert r.status == 410
    async with http.get(url, params={"offset": offsets.encode(3)}) as r:
        assert r.status == 410
    async with http.get(url, params={"offset": "-1"}) as r:  # the beginning: what is kept
        assert r.status == 200 and await r.read() == b"new"
    async with http.get(url, params={"offset": offsets.encode(9)}) as r:
        assert r.status == 200 and await r.read() == b"new"


async def test_hints_reach_workers(http, url, redis):
    await redis.set(keys.ARCHIVE_WORKER_ALIVE, "test", px=60_000)  # what a running worker says
    await create(http, url, "text/plain", b"x")
    for _ in range(30):
        if await redis.zscore(keys.ARCHIVE_HINTS, sid_of(url)) is not None:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("no hint within 3 s")


# -- exactly once ------------------------------------------------------------


class Crash(Exception):
    pass


async def check_once(redis: aioredis.Redis, archive: Archive, sid: str, expected: bytes) -> None:
    """Files plus the Redis log hold every byte once; no file outside the record."""
    meta = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.stream_keys(sid)[0])).items()}
    pieces: list[tuple[int, bytes]] = []
    recorded = set()
    if "inc" in meta:
        for member, score in await redis.zrange(keys.segments(sid, meta["inc"]), 0, -1, withscores=True):
            segment = Segment.parse(member)
            assert score >= 0, f"left over: {segment}"
            recorded.add(segment.file)
            rows = archive.read(segment.file).to_pylist()
            pieces += [(row["position"], row["data"]) for row in rows]
    for entry_id, fields in await redis.xrange(keys.stream_keys(sid)[1]):
        pieces.append((int(entry_id.split(b"-")[0]), fields[b"d"]))
    pieces.sort()
    positions = [p for p, _ in pieces]
    assert len(positions) == len(set(positions)), "a byte is stored twice"
    assert b"".join(d for _, d in pieces) == expected
    assert positions == sorted(positions) and all(
        a + len(d) == b for (a, d), b in zip(pieces, positions[1:], strict=False)
    ), "a gap"
    stray = {f for f in archive.files() if sid_digest(sid) in f} - recorded
    assert not stray, f"files outside the record: {stray}"


def sid_digest(sid: str) -> str:
    return hashlib.sha256(keys.path_of(sid).encode()).hexdigest()[:16]


async def leftovers(redis: aioredis.Redis, sids: list[str]) -> tuple[int, int, int]:
    """Committed, staged and garbage segment records across streams."""
    counts = [0, 0, 0]
    for sid in sids:
        inc = await redis.hget(keys.stream_keys(sid)[0], "inc")
        if inc:
            for _, score in await redis.zrange(keys.segments(sid, inc.decode()), 0, -1, withscores=True):
                counts[0 if score >= 0 else int(-score)] += 1
    return counts[0], counts[1], counts[2]


@pytest.mark.parametrize("point", ["after_stage", "after_write", "after_commit"])
async def test_a_crash_at_each_step_is_repaired(http, url, redis, archive_dir, point, monkeypatch):
    """The worker dies between steps (merging into an existing file, the hardest case);
    the next run repairs."""
    archive = Archive(archive_dir)
    bodies = [os.urandom(50) for _ in range(6)]
    await create(http, url, "application/octet-stream", *bodies[:3])
    await Archiver(redis, archive, HOT0).archive_stream(sid_of(url))
    for body in bodies[3:]:
        async with http.post(url, data=body, headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 204
    crashing = Archiver(redis, archive, HOT0)
    original_write, original_call = archive.write, crashing.leases.call

    def write(file, table, *rest):
        size = original_write(file, table, *rest)
        if point == "after_write":
            raise Crash
        return size

    async def call(script, *args):
        result = await original_call(script, *args)
        if (script, point) in (("archive_stage", "after_stage"), ("archive_commit", "after_commit")):
            raise Crash
        return result

    monkeypatch.setattr(archive, "write", write)
    monkeypatch.setattr(crashing.leases, "call", call)
    crashing.lease_seconds = 0.2  # the dead worker's lease runs out soon
    with pytest.raises(Crash):
        await crashing.archive_stream(sid_of(url))
    monkeypatch.undo()
    await asyncio.sleep(0.3)
    await Archiver(redis, Archive(archive_dir), HOT0).archive_stream(sid_of(url))
    await check_once(redis, Archive(archive_dir), sid_of(url), b"".join(bodies))
    assert len(await segments_of(redis, url)) == 1  # merged


async def test_sigkill_during_a_run_never_loses_or_doubles(http, gateway, redis, redis_url, archive_dir):
    """A real worker process, SIGKILLed at random moments while writers append."""
    streams = [f"{gateway}/kill-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    written = {s: bytearray() for s in streams}
    for s in streams:
        await create(http, s, "application/octet-stream")
    cmd = [sys.executable, "-m", "gateway", "archive", "--redis-url", redis_url, "--archive-url", archive_dir,
           "--archive-hot-bytes", "100", "--archive-hot-seconds", "0", "--archive-min-bytes", "0",
           "--archive-max-delay", "0", "--archive-file-bytes", "600", "--archive-interval", "0.01",
           "--archive-lease-seconds", "1", "--log-level", "error"]  # fmt: skip
    rng = random.Random(7)

    async def write_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            s = rng.choice(streams)
            body = os.urandom(rng.randint(1, 120))
            async with http.post(s, data=body, headers={"Content-Type": "application/octet-stream"}) as r:
                assert r.status == 204
            written[s] += body

    states = []
    for _ in range(8):
        worker = ready_worker(cmd)  # its loop runs: then it archives all along
        await write_for(rng.uniform(0.8, 1.5))
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        states.append(await leftovers(redis, [sid_of(s) for s in streams]))
    print("committed, staged, garbage after each kill:", states)
    assert states[-1][0] > len(streams)  # the killed workers did archive
    # A last worker, with the leases of the killed ones run out, finishes the job.
    await asyncio.sleep(0.1)
    last = Archiver(redis, Archive(archive_dir), Policy(hot_bytes=100, hot_ms=0, min_bytes=0, max_delay_ms=0,
                                                        file_bytes=600), lease_seconds=1)  # fmt: skip
    await asyncio.sleep(1.1)  # the killed worker's leases run out
    for s in streams:
        await last.archive_stream(sid_of(s))
        await check_once(redis, Archive(archive_dir), sid_of(s), bytes(written[s]))
        assert len(await segments_of(redis, s)) > 1  # in several files


async def test_two_workers_share_the_work(http, gateway, redis, archive_dir):
    streams = [f"{gateway}/pair-{uuid.uuid4().hex[:8]}-{i}" for i in range(12)]
    for s in streams:
        await create(http, s, "text/plain", *(f"{s[-2:]}:{n};".encode() for n in range(20)))
    await redis.zadd(keys.ARCHIVE_HINTS, {sid_of(s): 0 for s in streams})
    one, two = (Archiver(redis, Archive(archive_dir), HOT0, name=n) for n in ("one", "two"))
    taken = await asyncio.gather(one.work_once(limit=100), two.work_once(limit=100))
    assert sum(taken) >= len(streams)
    for s in streams:
        assert await log_length(redis, s) == 0
        expected = b"".join(f"{s[-2:]}:{n};".encode() for n in range(20))
        await check_once(redis, Archive(archive_dir), sid_of(s), expected)


def test_archive_command_uses_the_embedded_redis(tmp_path):
    """``archive`` beside ``serve`` on one data dir, with no Redis URL anywhere."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DURABLE_STREAMS_REDIS_URL")}
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port),
                              "--data-dir", str(tmp_path)], env=env)  # fmt: skip
    worker = None
    try:
        import urllib.request

        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        base = f"http://127.0.0.1:{port}/v1/stream/cli"
        request = urllib.request.Request(base, data=b"archived", method="PUT",
                                         headers={"Content-Type": "text/plain"})  # fmt: skip
        assert urllib.request.urlopen(request).status == 201
        worker = subprocess.Popen([sys.executable, "-m", "gateway", "archive", "--data-dir", str(tmp_path),
                                   "--archive-hot-bytes", "0", "--archive-hot-seconds", "0",
                                   "--archive-min-bytes", "0"], env=env)  # fmt: skip
        for _ in range(100):
            if list((tmp_path / "archive").rglob("*.parquet")):
                break
            time.sleep(0.1)
        assert list((tmp_path / "archive").rglob("*.parquet"))
        assert urllib.request.urlopen(base + "?offset=-1").read() == b"archived"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(10) == 0
    finally:
        for proc in (worker, serve):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)


async def test_object_store_urls_go_through_fsspec():
    """Non-local archives (S3 and friends) use fsspec's object calls; memory:// stands in here."""
    archive = Archive(f"memory://ds-test-{uuid.uuid4().hex[:8]}")
    assert not archive.local
    rows = [Row(0, b"ab", 1_000), Row(2, b"c", 2_000, ("p", 0, 1))]
    name = file_name("s/1", "inc", 0, 3, 1_000)
    archive.write(name, to_table("s/1", "inc", "text/plain", rows))
    assert archive.files() == [name]
    got = archive.read(name).to_pylist()
    assert [(r["data"], r["text"], r["producer_seq"]) for r in got] == [(b"ab", "ab", None), (b"c", "c", 1)]
    cold = ColdReader(archive, 1 << 20)
    segment = Segment(0, 3, 1_000, 2_000, name)
    assert await cold.take(segment, 1, None, 10, False, 10) == [(1, b"b"), (2, b"c")]
    archive.delete(name)
    assert archive.files() == []
    with pytest.raises(FileNotFoundError):
        archive.read(name)


async def test_s3_archive_end_to_end(http, redis, redis_url, s3_url):
    """Worker writes to S3, the gateway reads from it, deletion removes the objects."""
    from .conftest import start_gateway

    server = await start_gateway(redis_url, archive_url=s3_url, max_chunk_bytes=64)
    try:
        url = str(server.make_url(f"/v1/stream/s3-{uuid.uuid4().hex[:8]}"))
        await create(http, url, "text/plain", *(f"entry {n};".encode() for n in range(20)))
        hot = await transcript(http, url)
        archive = Archive(s3_url)
        await Archiver(redis, archive, HOT0).archive_stream(sid_of(url))
        assert await log_length(redis, url) == 0 and len(archive.files()) == 1
        assert await transcript(http, url) == hot
        async with http.delete(url) as r:
            assert r.status == 204
        await Archiver(redis, archive, HOT0).reconcile(force=True)
        assert archive.files() == []
    finally:
        await server.close()


async def test_catch_up_reads_while_files_are_merged_never_fail(
    http: aiohttp.ClientSession, own_redis, tmp_path: Path
) -> None:
    """A worker that merges small files every 0.1 s deletes each replaced file as soon as the
    merged one is committed: a read that looked the old one up a moment before finds it gone
    and asks again, a little apart, before it would answer 503."""
    from .conftest import serving
    from .faults.harness import ArchiveProc

    archive_dir = tmp_path / "archive"
    worker = ArchiveProc("merging", own_redis.url, archive_dir, tmp_path, lease_seconds=5)
    worker.args[worker.args.index("--archive-min-bytes") + 1] = "2048"  # merged at every round
    async with serving(own_redis.url, archive_url=str(archive_dir)) as base:
        url = f"{base}/merged"
        async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 201
        worker.start()
        written = bytearray()
        stop = asyncio.Event()
        reads, failures, got = 0, [], []

        async def write() -> None:
            n = 0
            while not stop.is_set():
                piece = f"{n:06d};".encode() * 20
                async with http.post(url, data=piece, headers={"Content-Type": "text/plain"}) as r:
                    assert r.status == 204
                written.extend(piece)
                n += 1
                await asyncio.sleep(0.002)

        async def read(rng: random.Random) -> None:
            nonlocal reads
            while not stop.is_set():
                if len(written) < 1000:
                    await asyncio.sleep(0.05)
                    continue
                at = rng.randrange(0, len(written) - 1)
                async with http.get(url, params={"offset": offsets.encode(at)}) as r:
                    body = await r.read()
                    if r.status != 200:
                        failures.append(f"{r.status} {body[:80]!r}")
                    else:
                        got.append((at, body))  # (checked at the end: it may hold appends not yet acked)
                reads += 1

        try:
            tasks = [asyncio.create_task(write())] + [
                asyncio.create_task(read(random.Random(i))) for i in range(4)
            ]
            await asyncio.sleep(10)
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            worker.kill()
    files = len(list(archive_dir.rglob("*.parquet")))
    failures += [f"offset {at}: other bytes" for at, body in got if not written[at:].startswith(body)]
    assert failures == [] and reads > 300 and files > 0, (failures[:5], reads, files)


# A worker merging every 0.2 s replaces a read's file at most this many times in a row
# while the read asks again (its retries wait ~2 s in all): it must ride them all out.
SURVIVED_MERGES = 7


async def test_a_read_rides_out_merges_that_delete_its_file(http, redis, redis_url, archive_dir, monkeypatch):
    """The race above, made deterministic: each time a catch-up read is about to open the
    archive file it looked up, a real merge by the worker commits a larger file in its place
    and deletes it. The read asks again each time: after SURVIVED_MERGES in a row it still
    answers the stream's bytes exactly (file, then Redis log); past FILE_RETRIES, a 503 with
    Retry-After, after which a read succeeds."""
    archive = Archive(archive_dir)
    server = await start_gateway(redis_url, archive_url=archive_dir)
    try:
        base = server.make_url("/v1/stream")
        ok_url, failing_url = (f"{base}/merged-{uuid.uuid4().hex[:8]}-{n}" for n in range(2))
        merges = {ok_url: SURVIVED_MERGES, failing_url: reads.FILE_RETRIES + 1}
        # One append a piece: the first archived alone, then one more merged in each time;
        # two left in the log (the surviving read goes on from the file into Redis).
        pieces = {u: [f"{u[-1]}:{n:02d};".encode() * 8 for n in range(k + 3)] for u, k in merges.items()}
        ends = {u: [sum(map(len, p[: n + 1])) for n in range(len(p))] for u, p in pieces.items()}
        for u, p in pieces.items():
            await create(http, u, "application/octet-stream", *p)
            first = dataclasses.replace(HOT0, hot_bytes=ends[u][-1] - ends[u][0])
            await Archiver(redis, archive, first).archive_stream(sid_of(u))
            assert [(s.start, s.end) for s in await segments_of(redis, u)] == [(0, ends[u][0])]

        cold = server.app[GATEWAY].store._reads.cold
        real_take = cold.take
        stream_of = {sid_digest(sid_of(u)): u for u in merges}
        opened = {u: [] for u in merges}  # the files each read went to open, in order
        merged = {u: [] for u in merges}  # (file replaced, file now committed, the old one still there)

        async def take(segment, *args):
            u = next(u for digest, u in stream_of.items() if digest in segment.file)
            opened[u].append(segment.file)
            done = len(merged[u])
            if done < merges[u]:  # a merge lands between the read's lookup and its open
                policy = dataclasses.replace(HOT0, hot_bytes=ends[u][-1] - ends[u][done + 1])
                await Archiver(redis, archive, policy).archive_stream(sid_of(u))
                (now,) = await segments_of(redis, u)
                merged[u].append((segment.file, now, (Path(archive_dir) / segment.file).exists()))
            return await real_take(segment, *args)

        monkeypatch.setattr(cold, "take", take)

        async def read(u: str) -> tuple[int, bytes, dict]:
            async with http.get(u, params={"offset": "-1"}) as r:
                return r.status, await r.read(), dict(r.headers)

        started = time.monotonic()
        (ok_status, ok_body, ok_headers), (failed, failed_body, failed_headers) = await asyncio.gather(
            read(ok_url), read(failing_url)
        )
        took = time.monotonic() - started

        assert (ok_status, ok_body) == (200, b"".join(pieces[ok_url])), ok_body[:80]
        assert ok_headers["Stream-Next-Offset"] == offsets.encode(ends[ok_url][-1])
        assert ok_headers["Stream-Up-To-Date"] == "true"
        for u, k in merges.items():  # every attempt but the last found its file merged away
            assert len(merged[u]) == k
            for n, (replaced, now, left) in enumerate(merged[u]):
                assert replaced == opened[u][n] and not left
                assert (now.start, now.end) == (0, ends[u][n + 1]) and now.file != replaced
        assert len(opened[ok_url]) == SURVIVED_MERGES + 1

        assert len(opened[failing_url]) == reads.FILE_RETRIES + 1  # then it gave up
        assert failed == 503 and b"archive file missing" in failed_body, (failed, failed_body)
        assert failed_headers.get("Retry-After") == "1"
        async with http.get(failing_url, params={"offset": "-1"}) as r:  # the retry it asked for
            assert (r.status, await r.read()) == (200, b"".join(pieces[failing_url]))
        print(f"both reads answered in {took:.2f} s")
    finally:
        await server.close()


def test_a_missing_archive_file_fails_its_stream_not_the_pass():
    """A file of one stream's gone (deleted by hand, another archive's stream): that stream
    is retried later (Archiver._take), the pass goes on; Redis out of reach ends the pass."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from workers.archive_scan import unavailable

    assert not unavailable(FileNotFoundError(2, "No such file", "date=x/a.parquet"))
    assert unavailable(RedisConnectionError("refused")) and unavailable(ConnectionRefusedError())
