"""When the archive worker archives, and how often it rewrites a file.

A stream is due max_delay after its first entry became *movable* (past both hot
windows), not after that entry was appended: a slow stream's entries leave the
byte window long after their append. And only files below min_bytes are merged
with (rewritten together with) the next round, so each byte is written a
bounded number of times. Real Redis, a real gateway; the worker is driven one
pass at a time.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

import aiohttp
import pyarrow as pa
import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy

from .test_archive import check_once, create, log_length, segments_of, sid_of, transcript

OCTET = {"Content-Type": "application/octet-stream"}
MAX_DELAY = 4.0  # seconds; the steps that must fall inside it take a few Redis calls


async def append(http: aiohttp.ClientSession, url: str, body: bytes) -> None:
    async with http.post(url, data=body, headers=OCTET) as r:
        assert r.status == 204, await r.text()


async def entry_ms(redis: aioredis.Redis, url: str, position: int) -> int:
    """When the log entry at ``position`` was appended (Redis's clock, as the worker sees it)."""
    ((_, fields),) = await redis.xrange(keys.stream_keys(sid_of(url))[1], f"{position}-1", f"{position}-1")
    return int(fields[b"t"])


async def hint_of(redis: aioredis.Redis, url: str) -> float | None:
    score: float | None = await redis.zscore(keys.ARCHIVE_HINTS, sid_of(url))
    return score


@pytest.fixture(autouse=True)
async def no_gateway_hints(redis: aioredis.Redis) -> None:
    """Gateways hint only while a worker is announced: with none, a stream's hint is
    the worker's own, and its score says when the worker will look again."""
    await redis.delete(keys.ARCHIVE_WORKER_ALIVE)


def still_before(due_ms: float) -> None:
    """Skip the test if the machine stalled until ``due_ms`` (then the pass just run may
    rightly have archived): nothing to conclude, rather than a failure."""
    if time.time() * 1000 >= due_ms - 50:
        pytest.skip("the machine stalled past the due time; nothing to conclude")


async def one_pass(worker: Archiver, url: str) -> None:
    """What a pass does with a due hint: take it (ZREM), then work on the stream."""
    await worker.redis.zrem(keys.ARCHIVE_HINTS, sid_of(url))
    await worker.archive_stream(sid_of(url))


async def test_a_slow_stream_waits_max_delay_from_when_it_became_movable(http, url, redis, archive_dir):
    """Entries appended long ago but only now pushed out of the byte window are not
    overdue: the round waits max_delay from the push, and then takes all that is movable."""
    policy = Policy(hot_bytes=1000, hot_ms=0, min_bytes=1 << 20, max_delay_ms=int(MAX_DELAY * 1000))
    worker = Archiver(redis, Archive(archive_dir), policy)
    sid = sid_of(url)
    bodies = [os.urandom(100) for _ in range(10)]
    await create(http, url, "application/octet-stream", *bodies)  # exactly the byte window
    await one_pass(worker, url)
    assert worker.files_written == 0 and await hint_of(redis, url) is None  # nothing movable
    await asyncio.sleep(MAX_DELAY + 0.5)  # the window's entries are now older than max_delay

    # Each append pushes one more entry out of the byte window; a pass follows each (as hints do).
    for n in range(3):
        body = os.urandom(100)
        await append(http, url, body)
        bodies.append(body)
        if n == 0:
            pushed = await entry_ms(redis, url, 1000)  # the entry holding byte 0 + 100 + 1000 - 1
        await one_pass(worker, url)
        still_before(pushed + MAX_DELAY * 1000)
        assert worker.files_written == 0, "archived before max_delay from becoming movable"
        assert await log_length(redis, url) == len(bodies)
        # Looked at again when the first entry is due (the gateway's NX hint cannot come earlier).
        assert await hint_of(redis, url) == pushed + MAX_DELAY * 1000

    await asyncio.sleep(max(0.0, (pushed + MAX_DELAY * 1000) / 1000 - time.time()) + 0.1)
    await one_pass(worker, url)
    assert worker.files_written == 1
    (segment,) = await segments_of(redis, url)
    assert (segment.start, segment.end) == (0, 300)  # every movable entry: 1300 bytes minus the window
    await check_once(redis, worker.archive, sid, b"".join(bodies))

    # The next entry left the byte window with the latest append: it is not due yet.
    await append(http, url, os.urandom(100))
    pushed = await entry_ms(redis, url, 1300)
    await one_pass(worker, url)
    still_before(pushed + MAX_DELAY * 1000)
    assert worker.files_written == 1
    assert await hint_of(redis, url) == pushed + MAX_DELAY * 1000


async def test_without_a_byte_window_an_entry_is_movable_once_old_enough(http, url, redis, archive_dir):
    """hot_bytes 0: an entry becomes movable hot_ms after its append; due max_delay later."""
    policy = Policy(hot_bytes=0, hot_ms=1000, min_bytes=1 << 20, max_delay_ms=2000)
    worker = Archiver(redis, Archive(archive_dir), policy)
    await create(http, url, "text/plain", b"first ", b"second")
    appended = await entry_ms(redis, url, 0)
    await one_pass(worker, url)
    still_before(appended + 1000 + 2000)
    assert worker.files_written == 0
    assert await hint_of(redis, url) == appended + 1000 + 2000  # not at append + hot_ms
    await asyncio.sleep(max(0.0, (appended + 3000) / 1000 - time.time()) + 0.1)
    await one_pass(worker, url)
    assert worker.files_written == 1 and await log_length(redis, url) == 0


class CountingArchive(Archive):
    """An archive that remembers, per log position, how many files it was written into."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.written: Counter[int] = Counter()

    def write(self, file: str, table: pa.Table, row_group_bytes: int = 4 << 20) -> int:
        self.written.update(table.column("position").to_pylist())
        return super().write(file, table, row_group_bytes)


async def test_a_day_of_small_rounds_rewrites_each_byte_a_bounded_number_of_times(
    http, url, redis, archive_dir
):
    """50 rounds of 100 bytes each (every one due at once). A file is merged with the next
    round only while it holds less than min_bytes (1000): so no entry is written into more
    than 10 files, where merging up to file_bytes wrote the first entry 50 times."""
    policy = Policy(hot_bytes=0, hot_ms=0, min_bytes=1000, max_delay_ms=0, file_bytes=1 << 20)
    archive = CountingArchive(archive_dir)
    worker = Archiver(redis, archive, policy)
    await create(http, url, "application/octet-stream")
    bodies = []
    for _ in range(50):
        body = os.urandom(100)
        await append(http, url, body)
        bodies.append(body)
        await one_pass(worker, url)
    assert worker.files_written == 50  # one write per round
    assert max(archive.written.values()) == 10, archive.written  # 100, 200, ... 1000 bytes
    assert sum(archive.written.values()) == 5 * sum(range(1, 11))  # 5 files of 10 rounds each
    segments = await segments_of(redis, url)
    assert [(s.start, s.end) for s in segments] == [(k * 1000, k * 1000 + 1000) for k in range(5)]
    assert await segments_of(redis, url, "-inf") == segments  # replaced files deleted
    await check_once(redis, archive, sid_of(url), b"".join(bodies))
    got = await transcript(http, url)
    assert b"".join(t[2] for t in got) == b"".join(bodies)


async def test_file_bytes_still_caps_merges_and_large_rounds(http, url, redis, archive_dir):
    """A merge never makes a file larger than file_bytes, and a large round is split."""
    policy = Policy(hot_bytes=0, hot_ms=0, min_bytes=1000, max_delay_ms=0, file_bytes=250)
    archive = CountingArchive(archive_dir)
    worker = Archiver(redis, archive, policy)
    bodies = [os.urandom(100) for _ in range(7)]
    await create(http, url, "application/octet-stream", *bodies[:5])  # one round: 500 bytes
    await one_pass(worker, url)
    for body in bodies[5:]:  # small rounds after it
        await append(http, url, body)
        await one_pass(worker, url)
    segments = await segments_of(redis, url)
    assert all(s.size <= 250 for s in segments), segments
    assert [(s.start, s.end) for s in segments] == [(0, 200), (200, 400), (400, 600), (600, 700)]
    # The 100-byte file at 400 took the next round (300 would pass 250: a file of its own).
    assert archive.written[400] == 2 and archive.written[600] == 1
    await check_once(redis, archive, sid_of(url), b"".join(bodies))


async def test_min_bytes_zero_never_merges(http, url, redis, archive_dir):
    """min_bytes 0 (archive whatever is movable at once): every round is a file of its own."""
    policy = Policy(hot_bytes=0, hot_ms=0, min_bytes=0, max_delay_ms=0, file_bytes=1 << 20)
    archive = CountingArchive(archive_dir)
    worker = Archiver(redis, archive, policy)
    bodies = [os.urandom(50) for _ in range(4)]
    await create(http, url, "application/octet-stream")
    for body in bodies:
        await append(http, url, body)
        await one_pass(worker, url)
    assert set(archive.written.values()) == {1}
    assert len(await segments_of(redis, url)) == 4
    await check_once(redis, archive, sid_of(url), b"".join(bodies))
