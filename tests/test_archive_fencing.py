"""Archive workers that lose their lease, and user paths that look like our keys.

A worker paused past its lease (a GC pause, a SIGSTOP'd pod, a slow PUT) must
change nothing once another worker has taken over, and must never delete a
file a committed segment names. Stream paths are the users': whatever they
hold, reconciliation finds and removes the archives of deleted streams.
Real Redis, real worker processes where a process is paused; no fakes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pyarrow as pa
import pytest
import redis.asyncio as aioredis
import yarl

from gateway.archive.files import Archive
from gateway.archive.schema import Row, to_table
from gateway.archive.segments import Segment, file_name
from gateway.protocol import offsets
from gateway.redis_io import keys
from gateway.redis_io.scripts import Scripts
from workers.archive_lease import Leases
from workers.archiver import Archiver, Lease
from workers.health import Heartbeat

from .conftest import ready_worker, start_gateway
from .test_archive import HOT0, check_once, create, segments_of, sid_of, transcript

LEASE = 0.6  # seconds: short, so a pause outlasts it quickly
OCTET = {"Content-Type": "application/octet-stream"}


async def append(http: aiohttp.ClientSession, url: str | yarl.URL, body: bytes) -> None:
    async with http.post(url, data=body, headers=OCTET) as r:
        assert r.status == 204, await r.text()


async def reads_back(http: aiohttp.ClientSession, url: str | yarl.URL, expected: bytes) -> None:
    """Every acknowledged byte reads back, from the start and from offset 0: no 410."""
    for start in ("-1", offsets.encode(0)):
        got = await transcript(http, url, start)
        assert [t[1] for t in got] == [200] * len(got), f"statuses from {start}: {[t[1] for t in got]}"
        assert b"".join(t[2] for t in got) == expected


async def staged(redis: aioredis.Redis, sid: str) -> list[bytes]:
    inc = await redis.hget(keys.stream_keys(sid)[0], "inc")
    return await redis.zrangebyscore(keys.segments(sid, inc.decode()), -1, -1) if inc else []


# -- a worker paused past its lease --------------------------------------------


class PausedWorker:
    """An Archiver on a thread and event loop of its own, archiving one stream. At
    ``point`` its whole loop blocks (so nothing renews its lease either: a GC pause
    or a SIGSTOP) until ``resume()``:

    * ``before_commit``: the file is written, the commit not yet sent;
    * ``during_write``: the file write is held too and lands only after the pause.
    """

    def __init__(self, redis_url: str, archive_dir: str, sid: str, point: str) -> None:
        self.redis_url, self.archive_dir, self.sid, self.point = redis_url, archive_dir, sid, point
        self.paused = threading.Event()
        self._resume = threading.Event()
        self.files_written = -1
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def resume(self) -> None:
        self._resume.set()

    def join(self) -> None:
        self._thread.join(30)
        assert not self._thread.is_alive()
        if self.error is not None:
            raise self.error

    def _pause(self) -> None:
        if not self.paused.is_set():
            self.paused.set()
            self._resume.wait(30)

    def _main(self) -> None:
        try:
            asyncio.run(self._work())
        except BaseException as error:  # surfaced by join()
            self.error = error

    async def _work(self) -> None:
        client = aioredis.Redis.from_url(self.redis_url)
        archive = Archive(self.archive_dir)
        worker = Archiver(client, archive, HOT0, lease_seconds=LEASE, name="paused")
        loop = asyncio.get_running_loop()
        original_call, original_write = worker.leases.call, archive.write

        async def call(script: str, *args: Any) -> Any:
            if script == "archive_commit" and self.point == "before_commit":
                self._pause()  # blocks this loop: no renewal runs
            return await original_call(script, *args)

        def write(file: str, table: pa.Table, *rest: Any) -> int:
            if self.point == "during_write" and not self.paused.is_set():
                loop.call_soon_threadsafe(self._pause)  # the loop stops too
                self.paused.wait(10)
                self._resume.wait(30)
            return original_write(file, table, *rest)

        worker.leases.call = call  # type: ignore[method-assign]
        archive.write = write  # type: ignore[method-assign]
        try:
            await worker.archive_stream(self.sid)
            self.files_written = worker.files_written
        finally:
            await client.aclose()


@pytest.mark.parametrize(
    "point,merged",
    [("before_commit", False), ("during_write", False), ("before_commit", True), ("during_write", True)],
)
async def test_a_paused_worker_cannot_undo_its_successor(
    http, url, redis, redis_url, archive_dir, point, merged
):
    """A pauses past its lease; B takes over and commits A's staged file (then, if
    ``merged``, merges it into a bigger one and deletes it). A resumes: its commit is
    refused and it deletes nothing a segment names (nor leaves its late file behind)."""
    sid = sid_of(url)
    bodies = [os.urandom(300) for _ in range(4)]
    await create(http, url, "application/octet-stream", *bodies[:2])
    paused = PausedWorker(redis_url, archive_dir, sid, point)
    paused.start()
    assert await asyncio.to_thread(paused.paused.wait, 10), "the worker never reached its pause"
    assert len(await staged(redis, sid)) == 1
    await asyncio.sleep(LEASE + 0.2)  # A's lease runs out: its loop is stopped, nothing renews it

    successor = Archiver(redis, Archive(archive_dir), HOT0, lease_seconds=LEASE, name="successor")
    await successor.archive_stream(sid)
    assert successor.files_written == 1  # redid A's staged file and committed it
    (redone,) = await segments_of(redis, url)
    if merged:
        for body in bodies[2:]:
            await append(http, url, body)
        await successor.archive_stream(sid)
        (merged_segment,) = await segments_of(redis, url)
        assert merged_segment.start == redone.start and merged_segment.end > redone.end
        assert not (Path(archive_dir) / redone.file).exists()
    else:
        bodies = bodies[:2]

    paused.resume()
    await asyncio.to_thread(paused.join)
    assert paused.files_written == 0  # its commit was refused; the round stopped there
    await check_once(redis, Archive(archive_dir), sid, b"".join(bodies))  # no stray, nothing missing
    for segment in await segments_of(redis, url):
        assert (Path(archive_dir) / segment.file).exists()
    await reads_back(http, url, b"".join(bodies))


async def test_renewal_keeps_the_lease_through_a_long_round(http, url, redis, archive_dir):
    """A round that outlasts the lease keeps it (renewed in the background), so
    no second worker takes the stream over meanwhile."""
    sid = sid_of(url)
    body = os.urandom(500)
    await create(http, url, "application/octet-stream", body)
    slow = Archiver(redis, Archive(archive_dir), HOT0, lease_seconds=LEASE, name="slow")
    original_call = slow.leases.call

    async def call(script: str, *args: Any) -> Any:
        if script == "archive_commit":
            await asyncio.sleep(4 * LEASE)  # a slow PUT: the loop runs, so renewals do
        return await original_call(script, *args)

    slow.leases.call = call  # type: ignore[method-assign]
    other = Archiver(redis, Archive(archive_dir), HOT0, lease_seconds=LEASE, name="other")

    async def try_to_take_over() -> None:
        for _ in range(3):
            await asyncio.sleep(LEASE)
            await other.archive_stream(sid)

    await asyncio.gather(slow.archive_stream(sid), try_to_take_over())
    assert (slow.files_written, other.files_written) == (1, 0)
    await check_once(redis, Archive(archive_dir), sid, body)
    await reads_back(http, url, body)


async def test_a_retried_commit_keeps_its_file(http, url, redis, archive_dir):
    """A commit whose reply was lost is sent again (redis-py retries on connection
    errors): the second answer must not make the worker delete the committed file."""
    sid = sid_of(url)
    bodies = [os.urandom(200) for _ in range(3)]
    await create(http, url, "application/octet-stream", bodies[0])
    await Archiver(redis, Archive(archive_dir), HOT0).archive_stream(sid)
    for body in bodies[1:]:
        await append(http, url, body)
    retrying = Archiver(redis, Archive(archive_dir), HOT0)
    original_call = retrying.leases.call

    async def call(script: str, *args: Any) -> Any:
        result = await original_call(script, *args)
        if script == "archive_commit":
            result = await original_call(script, *args)  # the same call again
        return result

    retrying.leases.call = call  # type: ignore[method-assign]
    await retrying.archive_stream(sid)
    # The merge's replaced file was still removed (the next round found it as garbage).
    await check_once(redis, Archive(archive_dir), sid, b"".join(bodies))
    assert len(await segments_of(redis, url)) == 1
    await reads_back(http, url, b"".join(bodies))


async def test_a_stale_token_changes_nothing(http, url, redis, archive_dir):
    """Every script that moves or deletes archive state refuses a token that is not
    the lease's (another worker's, or an expired lease), before touching anything."""
    sid = sid_of(url)
    await create(http, url, "application/octet-stream", b"abc", b"def")
    archiver = Archiver(redis, Archive(archive_dir), HOT0)
    await archiver.archive_stream(sid)
    (segment,) = await segments_of(redis, url)
    await append(http, url, b"ghi")
    meta_key, log_key = keys.stream_keys(sid)[:2]
    inc = (await redis.hget(meta_key, "inc")).decode()
    segs = keys.segments(sid, inc)

    async def state() -> tuple:
        return (await redis.hgetall(meta_key), await redis.zrange(segs, 0, -1, withscores=True),
                await redis.xlen(log_key), await redis.get(keys.lease(sid)))  # fmt: skip

    stale = Lease(sid, "not-the-holder", LEASE, time.monotonic() + 60)
    later = Segment(segment.end, segment.end + 3, 0, 0, file_name("x", inc, segment.end, segment.end + 3, 0))
    calls: list[tuple[str, tuple]] = [
        ("archive_stage", (inc, *later.member.split(" ", 4))),
        ("archive_commit", (inc, segment.member)),
        ("archive_forget", (inc, segment.member)),
        ("archive_retain", (inc, 2**50)),
        ("archive_replace", (inc, "stage", later.member, 0, 0, 0, 0, segment.member)),
        ("archive_replace", (inc, "commit", later.member, 0, 0, 0, 0, segment.member)),
        ("archive_check", (inc,)),
        ("archive_lease", (60_000,)),
        ("archive_lease", (0,)),
    ]
    for holder in ("someone-else", None):  # another worker's lease; no lease at all
        if holder:
            await redis.set(keys.lease(sid), holder, px=60_000)
        else:
            await redis.delete(keys.lease(sid))
        before = await state()
        for script, args in calls:
            assert await archiver.leases.call(script, stale, *args) == [b"lost"], script
        assert await state() == before
    assert (Path(archive_dir) / segment.file).exists()


def test_two_writers_of_one_file_at_once_both_succeed(tmp_path, monkeypatch):
    """Two workers (two pods, both PID 1: here two threads of one process) write the
    same file name at once; each writes its own temporary file, and the result is
    one of the two files whole."""
    archive = Archive(str(tmp_path))
    name = file_name("s", "inc", 0, 4, 1_000)
    tables = [to_table("s", "inc", "text/plain", [Row(0, data, 1_000)]) for data in (b"aaaa", b"bbbb")]
    real_fsync: Callable[[int], None] = os.fsync
    both_written = threading.Barrier(2, timeout=10)
    waited: set[int] = set()

    def fsync(fd: int) -> None:  # the first fsync of each writer waits for the other's data
        if threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            both_written.wait()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    errors: list[BaseException] = []

    def write(table: pa.Table) -> None:
        try:
            archive.write(name, table)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=write, args=(t,)) for t in tables]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    monkeypatch.undo()
    assert errors == []
    assert archive.read(name).column("data").to_pylist() in ([b"aaaa"], [b"bbbb"])
    assert sorted(p.name for p in (tmp_path / name).parent.iterdir()) == [Path(name).name]  # no temp left


# -- a real worker process, SIGSTOPped between staging and committing ----------


def worker_command(redis_url: str, archive_dir: str) -> list[str]:
    """A worker with no hot window that never merges (every file > 512 bytes): staging
    is directly followed by writing the file, then committing."""
    return [sys.executable, "-m", "gateway", "archive", "--redis-url", redis_url, "--archive-url",
            archive_dir, "--archive-hot-bytes", "0", "--archive-hot-seconds", "0", "--archive-min-bytes", "0",
            "--archive-max-delay", "0", "--archive-file-bytes", "512", "--archive-interval", "0.01",
            "--archive-lease-seconds", "1",
            "--archive-reconcile-seconds", "3600", "--log-level", "error"]  # fmt: skip


async def test_a_sigstopped_worker_process_is_fenced(http, redis, redis_url, archive_dir):
    """A real ``durable-streams archive`` process is stopped (SIGSTOP) while it holds
    a staged file, past its lease; another worker takes over and commits; then the
    process continues (SIGCONT). Every acknowledged byte still reads back."""
    server = await start_gateway(redis_url, archive_url=archive_dir)
    worker = None
    try:
        url = str(server.make_url(f"/v1/stream/stopped-{uuid.uuid4().hex[:8]}"))
        sid = sid_of(url)
        written = bytearray(os.urandom(1000))
        await create(http, url, "application/octet-stream", bytes(written))
        await Archiver(redis, Archive(archive_dir), HOT0).archive_stream(sid)  # the stream has an incarnation
        worker = ready_worker(worker_command(redis_url, archive_dir))  # its loop runs
        caught = False
        for _ in range(20):  # until the stop lands between stage and commit
            for _ in range(2):
                body = os.urandom(256 * 1024)  # big enough that writing the file takes a while
                await append(http, url, body)
                written += body
            await redis.zadd(keys.ARCHIVE_HINTS, {sid: 0})
            deadline = time.monotonic() + 20
            while not await staged(redis, sid):
                assert time.monotonic() < deadline, "the worker staged nothing"
            worker.send_signal(signal.SIGSTOP)
            if await staged(redis, sid):
                caught = True
                break
            worker.send_signal(signal.SIGCONT)  # it had committed already: again
            while await redis.xlen(keys.stream_keys(sid)[1]):
                await asyncio.sleep(0.01)
        assert caught, "never stopped the worker between stage and commit"
        await asyncio.sleep(1.3)  # its lease (1 s) runs out
        no_merge = dataclasses.replace(HOT0, file_bytes=512)  # the redone file stays as it is
        successor = Archiver(redis, Archive(archive_dir), no_merge, lease_seconds=1, name="successor")
        await successor.archive_stream(sid)
        assert successor.files_written >= 1
        worker.send_signal(signal.SIGCONT)
        await asyncio.sleep(1.5)  # it wakes up, tries to commit, and has a look at the file
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(10) == 0
        await successor.archive_stream(sid)  # anything left over (nothing, normally)
        await check_once(redis, Archive(archive_dir), sid, bytes(written))
        for segment in await segments_of(redis, url):
            assert (Path(archive_dir) / segment.file).exists()
        await reads_back(http, url, bytes(written))
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGCONT)
            worker.kill()
            worker.wait()
        await server.close()


# -- user paths that look like our key names ------------------------------------

# Paths a user may choose that look like parts of our key names, or hold the
# characters stream ids percent-encode.
ODD_PATHS = ["x:segs:y", "a}:segs:x", "b{:segs:}c", ":segs:", "x}:meta", "sp ace:meta", "pct%7D:segs:%25",
             "{y}:segs:z:meta", "n/ds:{q}:segs:r", "}:segs:{", "%", "ds:{t}:meta"]  # fmt: skip


def stream_url(gateway: str, path: str) -> yarl.URL:
    return yarl.URL(f"{gateway}/{quote(path, safe='/')}", encoded=True)


async def archived_streams(
    http: aiohttp.ClientSession, redis: aioredis.Redis, archiver: Archiver, gateway: str, paths: list[str]
) -> dict[str, tuple[yarl.URL, bytes, Segment]]:
    """Create, fill and archive a stream per path: path -> (url, data, its segment)."""
    out = {}
    for path in paths:
        url = stream_url(gateway, path)
        data = f"data of {path}".encode()
        await create(http, url, "application/octet-stream", data)
        sid = keys.stream_id(path)
        await archiver.archive_stream(sid)
        inc = (await redis.hget(keys.stream_keys(sid)[0], "inc")).decode()
        (member,) = await redis.zrange(keys.segments(sid, inc), 0, -1)
        out[path] = (url, data, Segment.parse(member))
    return out


async def test_user_paths_cannot_break_the_cleanup_scan(http, gateway, redis, archive_dir):
    """Streams whose paths hold ':segs:', ':meta', braces, '%' and spaces are archived,
    some deleted; reconciliation removes exactly the deleted ones' archives."""
    run = uuid.uuid4().hex[:6]
    paths = [f"{p}{run}" if i % 2 else f"{run}/{p}" for i, p in enumerate(ODD_PATHS)]
    archiver = Archiver(redis, Archive(archive_dir), HOT0)
    streams = await archived_streams(http, redis, archiver, gateway, paths)
    deleted, kept = paths[::2], paths[1::2]
    for path in deleted:
        async with http.delete(streams[path][0]) as r:
            assert r.status == 204
    assert await archiver.reconcile(force=True)
    for path in deleted:
        assert not (Path(archive_dir) / streams[path][2].file).exists(), path
        assert not [k async for k in redis.scan_iter(match=keys.segments(keys.stream_id(path), "*"))], path
    for path in kept:
        url, data, segment = streams[path]
        assert (Path(archive_dir) / segment.file).exists(), path
        await reads_back(http, url, data)
    index = {m.decode() for m in await redis.smembers(keys.ARCHIVE_SEGSETS)}
    for path in paths:
        named = {k for k in index if keys.split_segments_key(k)[0] == keys.stream_id(path)}
        assert len(named) == (path in kept), path  # gone with the archive; kept while it lives


async def test_one_odd_key_does_not_stop_a_pass(http, gateway, redis, archive_dir):
    """A key that matches the meta pattern but is no meta hash, and index entries that
    name no segment set, are skipped (and dropped from the index); the pass goes on."""
    run = uuid.uuid4().hex[:6]
    archiver = Archiver(redis, Archive(archive_dir), HOT0)
    odd_meta = [f"ds:odd-{run}:meta", f"ds:{{odd-{run}}}:meta"]  # no stream's: a string, a list
    await redis.set(odd_meta[0], "x")
    await redis.rpush(odd_meta[1], "x")
    try:
        streams = await archived_streams(http, redis, archiver, gateway, [f"{run}/gone"])
        url, _, segment = streams[f"{run}/gone"]
        async with http.delete(url) as r:
            assert r.status == 204
        assert await archiver.reconcile(force=True)
        assert not (Path(archive_dir) / segment.file).exists()

        bogus = [f"not-a-key-{run}", f"ds:{{odd-{run}}}:segs:", f"ds:{{odd-{run}}}:meta"]
        streams = await archived_streams(http, redis, archiver, gateway, [f"{run}/gone-too"])
        url, _, segment = streams[f"{run}/gone-too"]
        async with http.delete(url) as r:
            assert r.status == 204
        await redis.sadd(keys.ARCHIVE_SEGSETS, *bogus)
        assert await archiver.reconcile(force=True)
        assert not (Path(archive_dir) / segment.file).exists()
        assert await redis.smismember(keys.ARCHIVE_SEGSETS, bogus) == [0, 0, 0]
        assert await redis.type(odd_meta[1]) == b"list"  # left alone: not ours to remove
    finally:
        await redis.delete(*odd_meta)


async def test_archives_no_index_names_are_found_once_after_an_upgrade(http, gateway, redis, archive_dir):
    """Segment sets written before workers kept the index (an upgrade), of streams
    deleted since, are indexed by a worker's first reconciliation and removed."""
    run = uuid.uuid4().hex[:6]
    archiver = Archiver(redis, Archive(archive_dir), HOT0)
    streams = await archived_streams(http, redis, archiver, gateway, [f"{run}/old"])
    url, _, segment = streams[f"{run}/old"]
    (segs,) = [k async for k in redis.scan_iter(match=keys.segments(keys.stream_id(f"{run}/old"), "*"))]
    await redis.srem(keys.ARCHIVE_SEGSETS, segs)  # as an older worker left it: not indexed
    async with http.delete(url) as r:
        assert r.status == 204
    fresh = Archiver(redis, Archive(archive_dir), HOT0)  # a newly started worker
    assert await fresh.reconcile(force=True)
    assert not (Path(archive_dir) / segment.file).exists()
    assert not await redis.exists(segs)


async def test_a_round_ends_its_lease_renewals_though_redis_py_lost_the_cancellation(
    redis, monkeypatch
) -> None:
    """A round ends while its lease's renewal waits on Redis, redis-py answering with the
    cancellation lost: the renewals still end, promptly (they renewed for ever, and the
    round, its worker and a test of a SIGKILLed run waited on them)."""
    leases = Leases(redis, Scripts(redis), "w", 0.3, Heartbeat())
    sid = keys.stream_id(f"lease-{uuid.uuid4().hex[:8]}")
    renewing = asyncio.Event()
    call = leases.call

    async def swallowing(script: str, lease: Lease, *args: Any) -> Any:
        if args == (0,):  # the release, after the renewals
            return await call(script, lease, *args)
        renewing.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # (as redis-py does: the reply read, the cancellation lost)
        return await call(script, lease, *args)

    monkeypatch.setattr(leases, "call", swallowing)

    async def round_() -> None:
        async with leases.held(sid) as lease:
            assert lease is not None
            await asyncio.wait_for(renewing.wait(), 5)

    rounding = asyncio.create_task(round_())
    try:
        done, _ = await asyncio.wait({rounding}, timeout=5)
        assert done, "the round did not end: its lease's renewals go on"
        await rounding
    finally:
        rounding.cancel()
    assert await redis.get(keys.lease(sid)) is None  # released
