"""State compaction on stored streams (docs/compaction.md): the header, the worker's runs
(workers/compactor.py, lua/compact.lua) and every read path over what they keep.

Random State histories are appended to a compacted stream through a gateway in posts of
one or several messages, compacted by runs interleaved with the appends, and read back
through the gateway (small chunks and pages: the inline, bulk and streamed paths) from
``-1`` and from every kept offset, hot and once archived: what is read is exactly what the
rules keep (``compact``, the tests' reference), and every reader ends with the state of the
whole history (tests/test_compaction_rules.py has the models and the official referee).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import signal
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.archive.segments import Segment
from gateway.protocol import offsets
from gateway.protocol.compaction import compact
from gateway.redis_io import keys
from workers.archive_lease import LeaseLost
from workers.archiver import Archiver, Policy
from workers.compacted_segments import groups, rewritten
from workers.compactor import CompactionPolicy

from .conftest import ready_worker
from .test_compaction_rules import apply_merge, apply_replace, make_history, model

JSON = {"Content-Type": "application/json"}
NOW = CompactionPolicy(lag_ms=0, lag_bytes=0, tombstone_ms=3_600_000, min_interval_ms=0)
# Archive nothing unless a test says so (a hot window no stream here reaches).
NO_ARCHIVE = Policy(hot_bytes=1 << 40, hot_ms=0, min_bytes=1 << 20, max_delay_ms=0)
HOT0 = Policy(
    hot_bytes=0, hot_ms=0, min_bytes=1 << 20, max_delay_ms=0, file_bytes=1 << 20, row_group_bytes=64
)


def sid_of(url: str) -> str:
    return keys.stream_id(url.split("/v1/stream/", 1)[1])


def worker(
    redis: aioredis.Redis, archive_dir: str, policy: Policy = NO_ARCHIVE, **compaction: Any
) -> Archiver:
    options = {**NOW.__dict__, **compaction}
    return Archiver(redis, Archive(archive_dir), policy, compaction=CompactionPolicy(**options))


async def read_all(http: aiohttp.ClientSession, url: str, start: str = "-1") -> tuple[list[Any], str]:
    """Every message from ``start`` to the tail (headers.offset taken out), and the tail."""
    out: list[Any] = []
    offset = start
    seen = []
    for _ in range(2_000):
        async with http.get(url, params={"offset": offset}) as r:
            assert r.status == 200, (r.status, await r.text())
            seen.append((offset, r.headers["Stream-Next-Offset"], r.headers.get("Content-Length")))
            for item in orjson.loads(await r.read()):
                if isinstance(item, dict) and isinstance(item.get("headers"), dict):
                    item["headers"].pop("offset", None)
                out.append(item)
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                return out, offset
    raise AssertionError(f"no end: {seen[:5]} ... {seen[-5:]}")


async def append(http: aiohttp.ClientSession, url: str, messages: list[Any]) -> None:
    for i in range(0, len(messages), 40):  # (the session gateway takes bodies of 4 KiB at most)
        async with http.post(url, data=orjson.dumps(messages[i : i + 40]), headers=JSON) as r:
            assert r.status in (200, 204), await r.text()


async def create(http: aiohttp.ClientSession, url: str, **headers: str) -> None:
    async with http.put(url, headers={**JSON, "Stream-Compaction": "state", **headers}) as r:
        assert r.status == 201, await r.text()


def positioned(history: list[Any]) -> list[tuple[int, bytes]]:
    """The history as stored: (position, compact JSON) of each message."""
    out, at = [], 0
    for message in history:
        data = orjson.dumps(message)
        out.append((at, data))
        at += len(data)
    return out


async def test_the_header(http, gateway, redis):
    url = f"{gateway}/compaction-header-{random.randrange(1 << 30)}"
    await create(http, url)
    async with http.head(url) as r:
        assert r.headers["Stream-Compaction"] == "state"
    for headers, status in (
        ({"Stream-Compaction": "state"}, 200),  # the same: idempotent
        ({}, 200),  # not said: as it is (a policy may have decided, and may have changed since)
        ({"Stream-Compaction": "none"}, 409),  # said otherwise
    ):
        async with http.put(url, headers={**JSON, **headers}) as r:
            assert r.status == status, headers
    async with http.put(url + "-bytes", headers={"Stream-Compaction": "state"}) as r:
        assert r.status == 400 and "application/json" in await r.text()
    async with http.put(url + "-odd", headers={**JSON, "Stream-Compaction": "kafka"}) as r:
        assert r.status == 400
    async with http.put(url + "-none", headers={**JSON, "Stream-Compaction": "none"}) as r:
        assert r.status == 201 and "Stream-Compaction" not in r.headers
        assert b"cmp" not in await redis.hgetall(keys.stream_keys(sid_of(url + "-none"))[0])


async def test_the_policy_makes_streams_under_its_prefixes_compacted(http, redis_url):
    from .conftest import serving

    async with serving(redis_url, compaction_prefixes="state/, docs/") as base:
        tag = random.randrange(1 << 30)
        for path, headers, expected in (
            (f"state/a{tag}", JSON, "state"),
            (f"state/b{tag}", {**JSON, "Stream-Compaction": "none"}, None),
            (f"state/c{tag}", {"Content-Type": "text/plain"}, None),  # not JSON: passed over
            (f"other/d{tag}", JSON, None),
        ):
            async with http.put(f"{base}/{path}", headers=headers) as r:
                assert r.status == 201
                assert r.headers.get("Stream-Compaction") == expected, path


@pytest.mark.parametrize("seed", range(6))
async def test_reads_of_a_compacted_stream_are_what_the_rules_keep(http, gateway, redis, archive_dir, seed):
    rnd = random.Random(seed)
    history = make_history(rnd, rnd.randint(40, 160), keys=rnd.randint(1, 8), resets=True, others=True)
    url = f"{gateway}/compaction-reads-{seed}-{random.randrange(1 << 30)}"
    await create(http, url)
    sid = sid_of(url)
    archiver = worker(redis, archive_dir, step_positions=rnd.choice((3, 1000)))
    at = 0
    while at < len(history):  # posts of one or several messages, compacted now and then
        n = rnd.randint(1, 12)
        await append(http, url, history[at : at + n])
        at += n
        if rnd.random() < 0.3:
            await archiver.archive_stream(sid)
    assert await redis.xlen(keys.stream_keys(sid)[1]) == len(history) or rnd  # (one message an entry)
    await archiver.archive_stream(sid)
    stored = positioned(history)
    expected = [orjson.loads(m) for _, m in compact(stored, horizon=stored[-1][0] + 1)]
    got, tail = await read_all(http, url)
    assert got == expected
    assert offsets.decode(tail) == sum(len(m) for _, m in stored)  # the tail does not move
    assert model(got) == model(history) and model(got, apply_merge) == model(history, apply_merge)
    kept = {pos for pos, _ in compact(stored, horizon=stored[-1][0] + 1)}
    assert await redis.xlen(keys.stream_keys(sid)[1]) == len(kept)
    # From every kept offset (and from inside the dropped parts): the kept messages after it.
    for pos, _ in stored[:: max(1, len(stored) // 25)]:
        got_from, _ = await read_all(http, url, offsets.encode(pos))
        assert got_from == [orjson.loads(m) for p, m in stored if p >= pos and p in kept], pos
    async with http.head(url) as r:
        assert ":g" in r.headers["ETag"] or len(kept) == len(stored)
    # Archived: the same from the files (only what was folded goes there).
    await worker(redis, archive_dir, HOT0).archive_stream(sid)
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    assert int(meta[b"arch"]) == int(meta[b"cto"]) > 0
    assert (await read_all(http, url))[0] == expected


@pytest.mark.parametrize("seed", range(8))
async def test_archived_segments_are_compacted_too(http, gateway, redis, archive_dir, seed):
    """A worker that archives as it goes (small files, merged) folds the archive again in
    deep runs: segments are replaced by files of what the rules keep, and reads from every
    offset, cold or hot, are what a fold of the whole history keeps; deletes expire on a
    stream folded from its beginning, archived ones too."""
    rnd = random.Random(1000 + seed)
    history = make_history(rnd, rnd.randint(60, 200), keys=rnd.randint(1, 8), resets=True, others=True)
    url = f"{gateway}/compaction-archived-{seed}-{random.randrange(1 << 30)}"
    await create(http, url)
    sid = sid_of(url)
    tombstone_ms = rnd.choice((0, 3_600_000))
    files = Policy(hot_bytes=0, hot_ms=0, min_bytes=rnd.choice((1, 400)), max_delay_ms=0, file_bytes=1500)
    archiver = worker(
        redis, archive_dir, files, step_positions=rnd.choice((3, 1000)), dirty_ratio=rnd.choice((0, 0.5)),
        tombstone_ms=tombstone_ms,
    )  # fmt: skip
    at, replaced = 0, set()
    while at < len(history):
        n = rnd.randint(1, 12)
        await append(http, url, history[at : at + n])
        at += n
        if rnd.random() < 0.4:
            await archiver.archive_stream(sid)
            names = [s.file.rsplit("-", 1)[-1] for s in await archived(redis, sid)]
            replaced |= {name for name in names if name.startswith("c")}  # (segments.compacted_name)
    final = worker(redis, archive_dir, files, dirty_ratio=0, tombstone_ms=tombstone_ms)
    await final.archive_stream(sid)
    await asyncio.sleep(0.005)  # (deletes folded by that run are past a retention of 0 after it)
    await final.archive_stream(sid)  # (nothing new: a deep run only if a delete is due)
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    assert int(meta[b"arch"]) > 0 and replaced, "the archive was never compacted"
    stored = positioned(history)
    end = stored[-1][0] + 1
    kept_messages = compact(stored, horizon=end, tombstones_before_ms=1 << 62 if tombstone_ms == 0 else None)
    kept = {pos for pos, _ in kept_messages}
    got, tail = await read_all(http, url)
    assert got == [orjson.loads(m) for _, m in kept_messages]
    assert offsets.decode(tail) == sum(len(m) for _, m in stored)
    assert model(got) == model(history) and model(got, apply_merge) == model(history, apply_merge)
    for pos, _ in stored[:: max(1, len(stored) // 25)]:
        got_from, _ = await read_all(http, url, offsets.encode(pos))
        assert got_from == [orjson.loads(m) for p, m in stored if p >= pos and p in kept], pos
    # every file named is a kept one; no other file of the stream is left
    segments = await archived(redis, sid)
    files = Archive(archive_dir)
    rows = [p for s in segments for p in files.read(s.file, ["position"]).column(0).to_pylist()]
    assert rows == sorted(p for p in kept if p < int(meta[b"arch"]))
    digest = hashlib.sha256(keys.path_of(sid).encode()).hexdigest()[:16]  # (segments.file_name)
    assert {f for f in files.files() if digest in f} == {s.file for s in segments}


async def archived(redis: aioredis.Redis, sid: str) -> list[Segment]:
    """The stream's committed segments, in order."""
    inc = (await redis.hget(keys.stream_keys(sid)[0], "inc")).decode()
    members = await redis.zrangebyscore(keys.segments(sid, inc), 0, "+inf")
    return [Segment.parse(m) for m in members]


async def test_a_run_stops_when_its_lease_is_lost_and_the_next_one_finishes(
    http, gateway, redis, archive_dir
):
    history = [
        {"type": "t", "key": f"k{i % 5}", "value": {"v": i}, "headers": {"operation": "upsert"}}
        for i in range(200)
    ]
    url = f"{gateway}/compaction-lease-{random.randrange(1 << 30)}"
    await create(http, url)
    await append(http, url, history)
    sid = sid_of(url)
    archiver = worker(redis, archive_dir, step_positions=10)
    calls = 0
    fenced = archiver.leases.fenced

    async def steal_after_three(script: str, lease: Any, *args: Any) -> list[Any]:
        nonlocal calls
        calls += 1
        if calls == 4:  # another worker took the lease (this one was paused past it)
            await redis.set(keys.lease(sid), "someone-else")
        return await fenced(script, lease, *args)

    archiver.leases.fenced = steal_after_three  # type: ignore[method-assign]
    async with archiver.leases.held(sid) as lease:
        assert lease is not None
        meta = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.stream_keys(sid)[0])).items()}
        with pytest.raises(LeaseLost):
            await archiver.compactor.run(lease, meta)
    # three steps of ten applied, nothing since; the fold point did not move; readers agree
    assert await redis.xlen(keys.stream_keys(sid)[1]) == 200 - 30
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    assert b"cto" not in meta and int(meta[b"cnext"]) > 0
    got, _ = await read_all(http, url)
    assert model(got) == model(history)
    await redis.delete(keys.lease(sid))
    await worker(redis, archive_dir).archive_stream(sid)
    got, _ = await read_all(http, url)
    assert got == history[-5:] and await redis.xlen(keys.stream_keys(sid)[1]) == 5


async def test_forks_keep_their_history(http, gateway, redis, archive_dir):
    history = [
        {"type": "t", "key": f"k{i % 3}", "value": {"v": i}, "headers": {"operation": "upsert"}}
        for i in range(30)
    ]
    url = f"{gateway}/compaction-forks-{random.randrange(1 << 30)}"
    await create(http, url)
    await append(http, url, history[:20])
    sid = sid_of(url)
    archiver = worker(redis, archive_dir)
    await archiver.archive_stream(sid)
    middle = sum(len(orjson.dumps(m)) for m in history[:10])
    source = urlsplit(url).path
    early = {**JSON, "Stream-Forked-From": source, "Stream-Fork-Offset": offsets.encode(middle)}
    async with http.put(url + "-early", headers=early) as r:
        assert r.status == 409 and "compacted" in await r.text()  # its history there is gone
    async with http.put(url + "-fork", headers={**JSON, "Stream-Forked-From": source}) as r:
        assert r.status == 201, await r.text()
    fork_before, _ = await read_all(http, url + "-fork")
    await append(http, url, history[20:])  # newer versions of every row in the source ...
    await archiver.archive_stream(sid)  # ... compacted: nothing below the fork point goes
    assert (await read_all(http, url + "-fork"))[0] == fork_before
    assert model(fork_before) == model(history[:20])
    assert model((await read_all(http, url))[0]) == model(history)


async def test_a_large_append_stores_a_message_an_entry(http, gateway, redis_url, redis, archive_dir):
    from .conftest import serving

    messages = [
        {
            "type": "t",
            "key": f"k{i % 100}",
            "value": {"v": i, "pad": "x" * 40},
            "headers": {"operation": "upsert"},
        }
        for i in range(30_000)
    ]  # ~2.5 MB: written in parts
    async with serving(redis_url, max_body_bytes=8 << 20) as base:
        url = f"{base}/compaction-large-{random.randrange(1 << 30)}"
        await create(http, url)
        await append(http, url, messages)
        sid = sid_of(url)
        assert await redis.xlen(keys.stream_keys(sid)[1]) == len(messages)
        await worker(redis, archive_dir).archive_stream(sid)
        got, _ = await read_all(http, url)
        assert got == messages[-100:]


async def test_streams_without_the_setting_are_never_touched(http, gateway, redis, archive_dir):
    url = f"{gateway}/compaction-none-{random.randrange(1 << 30)}"
    async with http.put(url, headers=JSON) as r:
        assert r.status == 201
    history = [
        {"type": "t", "key": "k", "value": {"v": i}, "headers": {"operation": "upsert"}} for i in range(50)
    ]
    await append(http, url, history)
    await worker(redis, archive_dir).archive_stream(sid_of(url))
    assert (await read_all(http, url))[0] == history
    await asyncio.sleep(0)


async def test_workers_killed_and_paused_never_drop_a_kept_message(
    http, gateway, redis, redis_url, archive_dir
):
    """Real worker processes compacting (and archiving) while writers append and readers read
    on, SIGKILLed and SIGSTOPped past their lease at random moments (the paused one resumed
    while another holds its streams): every reader, holding its state across hops, ends with
    the state of the whole history, and a last run keeps of what Redis holds exactly what the
    rules keep."""
    rnd = random.Random(11)
    streams = [f"{gateway}/compaction-kill-{random.randrange(1 << 30)}-{i}" for i in range(3)]
    histories: dict[str, list[Any]] = {s: [] for s in streams}
    for s in streams:
        await create(http, s)
    cmd = [sys.executable, "-m", "gateway", "archive", "--redis-url", redis_url, "--archive-url", archive_dir,
           "--archive-hot-bytes", "3000", "--archive-hot-seconds", "0", "--archive-min-bytes", "0",
           "--archive-max-delay", "0", "--archive-interval", "0.01", "--archive-lease-seconds", "1",
           "--compaction-lag-seconds", "0", "--compaction-lag-bytes", "300",
           "--compaction-tombstone-seconds", "3600", "--compaction-interval-seconds", "0",
           "--log-level", "error"]  # fmt: skip
    done = asyncio.Event()
    n = 0

    async def write() -> None:
        nonlocal n
        while not done.is_set():
            s = rnd.choice(streams)
            batch = []
            for _ in range(rnd.randint(1, 6)):
                n += 1
                key = f"k{rnd.randrange(6)}"
                op = rnd.choice(("upsert", "upsert", "update", "delete"))
                event: dict[str, Any] = {"type": "t", "key": key, "headers": {"operation": op}}
                if op != "delete":
                    event["value"] = {rnd.choice("ab"): n}
                batch.append(event)
            await append(http, s, batch)
            histories[s] += batch
            await asyncio.sleep(0.005)

    async def read(s: str) -> dict[Any, Any]:
        state: dict[Any, Any] = {}
        offset = "-1"
        while True:
            async with http.get(s, params={"offset": offset}) as r:
                assert r.status == 200, await r.text()
                for item in orjson.loads(await r.read()):
                    apply_merge(state, item)
                offset = r.headers["Stream-Next-Offset"]
                if done.is_set() and r.headers.get("Stream-Up-To-Date") == "true":
                    return state
            await asyncio.sleep(rnd.random() * 0.05)

    writer = asyncio.create_task(write())
    readers = [asyncio.create_task(read(s)) for s in streams]
    try:
        for round_ in range(6):
            proc = await asyncio.to_thread(ready_worker, cmd)
            await asyncio.sleep(rnd.uniform(0.5, 1.2))
            if round_ % 2:  # paused past its lease while another takes over, then resumed
                proc.send_signal(signal.SIGSTOP)
                other = await asyncio.to_thread(ready_worker, cmd)
                await asyncio.sleep(1.5)
                proc.send_signal(signal.SIGCONT)
                await asyncio.sleep(0.5)
                other.send_signal(signal.SIGKILL)
                await asyncio.to_thread(other.wait)
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
    finally:
        done.set()
        await writer
    states = await asyncio.gather(*readers)
    await asyncio.sleep(1.1)  # the killed workers' leases run out
    metas = [await redis.hgetall(keys.stream_keys(sid_of(s))[0]) for s in streams]
    assert sum(int(meta.get(b"cdropn", 0)) for meta in metas) > 0  # the killed workers compacted
    assert any(int(meta.get(b"arch", 0)) for meta in metas)  # ... and archived (cold reads too)
    last = worker(redis, archive_dir)  # (archives nothing more)
    for s, state in zip(streams, states, strict=True):
        history = histories[s]
        assert state == model(history, apply_merge), s
        await last.archive_stream(sid_of(s))
        got, _ = await read_all(http, s)
        assert model(got) == model(history) and model(got, apply_merge) == model(history, apply_merge), s
        # What Redis holds (archived messages are kept as archived) is what the rules keep of it.
        arch = int((await redis.hget(keys.stream_keys(sid_of(s))[0], "arch")) or 0)
        hot = [(p, m) for p, m in positioned(history) if p >= arch]
        got, _ = await read_all(http, s, offsets.encode(arch))
        assert got == [orjson.loads(m) for _, m in compact(hot, horizon=hot[-1][0] + 1)], s


async def test_a_delete_goes_once_its_retention_passed_on_an_idle_stream(http, gateway, redis, archive_dir):
    events = [
        {"type": "t", "key": "a", "value": {"v": 1}, "headers": {"operation": "insert"}},
        {"type": "t", "key": "a", "headers": {"operation": "delete"}},
        {"type": "t", "key": "b", "value": {"v": 2}, "headers": {"operation": "insert"}},
    ]
    url = f"{gateway}/compaction-idle-{random.randrange(1 << 30)}"
    await create(http, url)
    await append(http, url, events)
    sid = sid_of(url)
    await worker(redis, archive_dir).archive_stream(sid)  # the delete stays (retention: an hour)
    assert (await read_all(http, url))[0] == events[1:]
    async with http.head(url) as r:
        tag = r.headers["ETag"]
    await worker(redis, archive_dir, tombstone_ms=0).archive_stream(sid)  # nothing new: it goes now
    assert (await read_all(http, url))[0] == events[2:]
    async with http.head(url) as r:
        assert r.headers["ETag"] != tag  # what a read from 0 holds changed: so does its tag


async def test_nothing_is_dropped_before_layout_v4_is_written(http, gateway, redis, archive_dir):
    """Builds before key layout v4 misread gaps: during a rolling upgrade from one (the
    layout written is still v3) the workers leave compacted streams as they are."""
    url = f"{gateway}/compaction-v3-{random.randrange(1 << 30)}"
    await create(http, url)
    history = [
        {"type": "t", "key": "k", "value": {"v": i}, "headers": {"operation": "upsert"}} for i in range(9)
    ]
    await append(http, url, history)
    archiver = worker(redis, archive_dir)
    archiver.compactor.writing = lambda: 3
    await archiver.archive_stream(sid_of(url))
    assert (await read_all(http, url))[0] == history
    archiver.compactor.writing = lambda: None  # not known now (its fleet lease may have ended)
    await archiver.archive_stream(sid_of(url))
    assert (await read_all(http, url))[0] == history
    archiver.compactor.writing = lambda: 4  # switched
    await archiver.archive_stream(sid_of(url))
    assert (await read_all(http, url))[0] == history[-1:]


@pytest.mark.parametrize("below", ["archived", "forked"])
async def test_deletes_stay_where_the_fold_does_not_start_at_the_beginning(
    http, gateway, redis, archive_dir, below
):
    """An older write of a deleted key below where runs fold (archived, or below a fork
    point) would come back to life without its delete: such streams keep their deletes."""
    url = f"{gateway}/compaction-keep-deletes-{below}-{random.randrange(1 << 30)}"
    first = [{"type": "t", "key": "a", "value": {"v": 1}, "headers": {"operation": "insert"}}]
    first += [
        {"type": "t", "key": "b", "value": {"v": n}, "headers": {"operation": "upsert"}} for n in range(3)
    ]
    later = [{"type": "t", "key": "a", "headers": {"operation": "delete"}}]
    later += [
        {"type": "t", "key": "c", "value": {"v": n}, "headers": {"operation": "upsert"}} for n in range(3)
    ]
    await create(http, url)
    await append(http, url, first)
    sid = sid_of(url)
    if below == "archived":
        await worker(redis, archive_dir, HOT0).archive_stream(sid)
        assert int(await redis.hget(keys.stream_keys(sid)[0], "arch")) > 0
    else:
        async with http.put(url + "-fork", headers={**JSON, "Stream-Forked-From": urlsplit(url).path}) as r:
            assert r.status == 201
    await append(http, url, later)
    await worker(redis, archive_dir, tombstone_ms=0).archive_stream(sid)
    got, _ = await read_all(http, url)
    assert later[0] in got and model(got) == model(first + later)


async def test_a_segment_left_pending_by_a_lost_worker_does_not_skip_the_next_run(
    http, gateway, redis, archive_dir
):
    """A take of a stream first finishes a segment a killed worker staged, then compacts:
    the take's one run is not spent on the pending segment's round."""
    url = f"{gateway}/compaction-pending-{random.randrange(1 << 30)}"
    versions = [
        {"type": "t", "key": f"k{n % 3}", "value": {"v": n}, "headers": {"operation": "upsert"}}
        for n in range(30)
    ]
    await create(http, url)
    await append(http, url, versions[:15])
    sid = sid_of(url)
    killed = worker(redis, archive_dir, HOT0)

    async def die(*args: Any) -> bool:
        raise RuntimeError("killed while writing its segment")

    killed.files.write_and_commit = die  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await killed.archive_stream(sid)  # compacted, then staged a segment and died
    await append(http, url, versions[15:])
    await worker(redis, archive_dir, HOT0).archive_stream(sid)
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    assert int(meta[b"arch"]) > 0  # the pending segment was written
    got, _ = await read_all(http, url)
    assert got == versions[-3:]  # and everything folded in the same take, archived or not


def upsert(key: str, v: int) -> dict[str, Any]:
    return {"type": "t", "key": key, "value": {"v": v}, "headers": {"operation": "upsert"}}


def delete(key: str) -> dict[str, Any]:
    return {"type": "t", "key": key, "headers": {"operation": "delete"}}


EVERYTHING = Policy(
    hot_bytes=0, hot_ms=0, min_bytes=1, max_delay_ms=0, file_bytes=1 << 20
)  # archived at once


async def test_a_delete_outlives_the_write_a_deep_run_drops_for_it(http, gateway, redis, archive_dir):
    """A delete folded while its key's older write was archived (a run in Redis cannot drop
    that write) is kept for the whole retention after the deep run that drops the write: a
    reader that read the write just before must still find the delete."""
    url = f"{gateway}/compaction-late-drop-{random.randrange(1 << 30)}"
    await create(http, url)
    sid = sid_of(url)
    w = worker(redis, archive_dir, EVERYTHING, tombstone_ms=300, dirty_ratio=1000.0)
    history = [upsert("a", 1), upsert("b", 1)]
    for message in history:
        await append(http, url, [message])
        await w.archive_stream(sid)  # (the second: a first deep run, then the ratio holds them back)
    history += [upsert("x", 1), upsert("c", 1)]
    await append(http, url, history[-2:])
    await w.archive_stream(sid)  # x archived
    history += [delete("x"), upsert("d", 1)]
    await append(http, url, history[-2:])
    await w.archive_stream(sid)  # the delete folded in Redis, x:1 archived: kept
    await asyncio.sleep(0.5)  # the delete's retention ends: a deep run is due
    got, _ = await read_all(http, url)
    assert upsert("x", 1) in got and delete("x") in got
    at = sum(len(orjson.dumps(m)) for m in history[: history.index(upsert("x", 1)) + 1])
    state = model(got[: got.index(upsert("x", 1)) + 1])  # a reader from -1 has read x:1 ...
    await w.archive_stream(sid)  # ... when the deep run drops x:1
    rest, _ = await read_all(http, url, offsets.encode(at))
    assert delete("x") in rest  # (its retention starts again)
    for message in rest:
        apply_replace(state, message)
    assert state == model(history)
    got, _ = await read_all(http, url)
    assert upsert("x", 1) not in got
    await asyncio.sleep(0.4)
    await w.archive_stream(sid)  # a retention later it goes
    got, _ = await read_all(http, url)
    assert delete("x") not in got and model(got) == model(history)


async def test_a_fork_inside_what_a_deep_run_compacts_is_refused(http, gateway, redis, archive_dir):
    url = f"{gateway}/compaction-deep-fork-{random.randrange(1 << 30)}"
    await create(http, url)
    sid = sid_of(url)
    w = worker(redis, archive_dir, EVERYTHING, dirty_ratio=0)
    history = [upsert("x", 1), upsert("y", 1)]
    await append(http, url, history)
    await w.archive_stream(sid)
    upto = int(await redis.hget(keys.stream_keys(sid)[0], "cto"))
    history += [upsert("z", 1), upsert("x", 2)]  # x:2 makes the archived x:1 redundant
    await append(http, url, history[2:])
    point = upto + len(orjson.dumps(history[2]))  # after z, before x:2: in what the run folds
    replace, answers = w.compactor.archived.replace, []

    async def fork_first(*args: Any) -> Any:  # a fork asked for while the run replaces a segment
        headers = {
            **JSON,
            "Stream-Forked-From": urlsplit(url).path,
            "Stream-Fork-Offset": offsets.encode(point),
        }
        async with http.put(url + "-fork", headers=headers) as r:
            answers.append(r.status)
        return await replace(*args)

    w.compactor.archived.replace = fork_first  # type: ignore[method-assign]
    await w.archive_stream(sid)
    assert answers == [409]
    got, _ = await read_all(http, url)
    assert got == history[1:]


async def test_a_missing_archived_file_does_not_stop_the_stream(http, gateway, redis, archive_dir):
    """A deep run that meets a missing file folds Redis only: archiving goes on."""
    url = f"{gateway}/compaction-missing-file-{random.randrange(1 << 30)}"
    await create(http, url)
    sid = sid_of(url)
    w = worker(redis, archive_dir, EVERYTHING, dirty_ratio=0)
    await append(http, url, [upsert("a", 1), upsert("b", 1)])
    await w.archive_stream(sid)
    (segment,) = await archived(redis, sid)
    (Path(archive_dir) / segment.file).unlink()
    before = int(await redis.hget(keys.stream_keys(sid)[0], "arch"))
    await append(http, url, [upsert("c", n) for n in range(20)])
    await w.archive_stream(sid)
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    assert int(meta[b"arch"]) > before and int(meta[b"cto"]) == int(meta[b"tail"])


async def test_a_deep_run_joins_small_files(http, gateway, redis, archive_dir):
    """Each archiving round wrote a file; compacted down to little, a deep run writes the
    day's small neighbours as one (a deep run reads every file: few stay for it to read)."""
    url = f"{gateway}/compaction-join-{random.randrange(1 << 30)}"
    await create(http, url)
    sid = sid_of(url)
    history = []
    for n in range(12):
        history += [upsert("a", n), upsert("b", n)]
        await append(http, url, history[-2:])
        await worker(redis, archive_dir, EVERYTHING, dirty_ratio=1e9).archive_stream(sid)
    assert len(await archived(redis, sid)) >= 10
    joining = dataclasses.replace(EVERYTHING, min_bytes=1 << 20)
    await worker(redis, archive_dir, joining, dirty_ratio=0).archive_stream(sid)
    segments = await archived(redis, sid)
    assert len(segments) <= 2  # (one a UTC day: this test may run across midnight)
    arch = int(await redis.hget(keys.stream_keys(sid)[0], "arch"))
    assert segments[0].start == 0 and segments[-1].end == arch
    got, _ = await read_all(http, url)
    assert got == history[-2:]


def test_which_segments_a_deep_run_writes_as_one_file():
    day, next_day = 1_795_900_000_000, 1_795_900_000_000 + 86_400_000
    segments = [
        Segment(0, 100, day, day, "a"),
        Segment(100, 200, day, day, "b"),
        Segment(200, 300, day, day, "c"),  # its kept bytes would pass the target with a and b
        Segment(300, 400, next_day, next_day, "d"),  # another day
        Segment(400, 500, next_day, next_day, "e"),
    ]
    kept, drops = [10, 10, 90, 5, 500], {1: {150}, 4: {450}}
    parts = groups(segments, kept, drops, target=100)
    assert [[s.file for s in group] for group, _ in parts] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [sorted(dropped) for _, dropped in parts] == [[150], [], [], [450]]
    assert [rewritten(part) for part in parts] == [True, False, False, True]


async def test_an_archived_streams_last_delete_goes_once_more_is_folded(http, gateway, redis, archive_dir):
    """On an archived stream only a deep run drops deletes: the worker wakes one when a
    delete's retention ends (no append needed), and a delete it could not drop then (the
    newest folded message) goes with the deep run after the next message is folded."""
    url = f"{gateway}/compaction-last-delete-{random.randrange(1 << 30)}"
    await create(http, url)
    sid = sid_of(url)
    w = worker(redis, archive_dir, EVERYTHING, tombstone_ms=300, dirty_ratio=1e9)
    history = [upsert("b", 1)]
    for n in range(2):  # archived; the second take's deep run paces the next by the ratio
        history.append(upsert("b", n + 2))
        await append(http, url, history[-1:])
        await w.archive_stream(sid)
    history += [upsert("a", 1), delete("a")]
    await append(http, url, history[-2:])
    await redis.zrem(keys.ARCHIVE_HINTS, sid)
    await w.archive_stream(sid)  # a run in Redis folds the delete (which stays), then archives
    assert await redis.zscore(keys.ARCHIVE_HINTS, sid) is not None  # a look once its retention ends
    await asyncio.sleep(0.4)
    await w.archive_stream(sid)  # a deep run: the delete is the newest message, kept
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    assert meta[b"ckw"] == b"1" and delete("a") in (await read_all(http, url))[0]
    history.append(upsert("c", 1))
    await append(http, url, history[-1:])
    await redis.zrem(keys.ARCHIVE_HINTS, sid)
    await w.archive_stream(sid)  # folds c in Redis, and asks for the deep run soon
    assert await redis.zscore(keys.ARCHIVE_HINTS, sid) is not None
    await w.archive_stream(sid)
    got, _ = await read_all(http, url)
    assert got == [upsert("b", 3), upsert("c", 1)]


async def test_a_missing_file_holds_deep_runs_back_by_the_ratio(http, gateway, redis, archive_dir):
    url = f"{gateway}/compaction-missing-backoff-{random.randrange(1 << 30)}"
    await create(http, url)
    sid = sid_of(url)
    w = worker(redis, archive_dir, EVERYTHING, dirty_ratio=0.5)
    await append(http, url, [upsert("a", n) for n in range(5)] + [upsert("b", 1)])
    await w.archive_stream(sid)
    (Path(archive_dir) / (await archived(redis, sid))[0].file).unlink()
    await append(http, url, [upsert("a", 9)])
    await w.archive_stream(sid)  # a deep run meets the missing file: folds Redis only
    meta = await redis.hgetall(keys.stream_keys(sid)[0])
    assert int(meta[b"cac"]) == int(meta[b"cto"])  # as if it had run: the next waits for the ratio
