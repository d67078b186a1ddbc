"""The console's live statistics (gateway/features/stats.py, gateway/http/stats.py): the
buckets each process records and what a read sums up, against the real test Redis
(under a hash tag of the test's own, with set counters and clocks); then over HTTP, two
gateways on one Redis of the test's own, appends and live readers on both, and both
answering the same numbers; access control; the subscriptions with their state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.cli.embedded import EmbeddedRedis
from gateway.features import stats
from gateway.redis_io import keys
from gateway.redis_io.scripts import Scripts, connect_scripts

from .conftest import free_port, serving, wait_ready

T0 = 1_700_000_000_000  # a bucket's start (ms): the unit tests' clock
TEXT = {"Content-Type": "text/plain"}


class SetCounters(stats.ProcessCounters):
    """Counters a test sets: what the next tick takes, and the live readers now."""

    def __init__(self) -> None:
        super().__init__()
        self.grown = (0, 0)
        self.readers = (0, 0)

    def start(self) -> None:
        pass

    def take(self) -> tuple[int, int]:
        grown, self.grown = self.grown, (0, 0)
        return grown

    def live(self) -> tuple[int, int]:  # type: ignore[override]
        return self.readers


@pytest.fixture
async def scripts(redis_url: str) -> AsyncIterator[Scripts]:
    found = connect_scripts(redis_url, cluster=False, max_connections=4, timeout=5.0)
    yield found
    await found.aclose()


@pytest.fixture
async def tag(redis: aioredis.Redis) -> AsyncIterator[str]:
    """A hash tag of this test's own; its keys go when it ends."""
    name = f"{{test-stats-{uuid.uuid4().hex[:8]}}}"
    yield name
    found = [key async for key in redis.scan_iter(match=f"{name}*")]
    if found:
        await redis.delete(*found)


def recorder(scripts: Scripts, tag: str, name: str, **options: Any) -> tuple[stats.Recorder, SetCounters]:
    counters = SetCounters()
    found = stats.Recorder(scripts, lambda sid: 0, [f"{tag}:hints"], counters=counters, tag=tag, **options)
    found.process = found.instance = name
    return found, counters


# -- recording and reading ----------------------------------------------------------------


async def test_buckets_sum_every_process(scripts: Scripts, tag: str, redis: aioredis.Redis) -> None:
    a, counts_a = recorder(scripts, tag, "gw-a")
    b, counts_b = recorder(scripts, tag, "gw-b")
    counts_a.grown, counts_a.readers = (5, 500), (2, 1)
    await a.tick(T0 + 1000)
    counts_b.grown, counts_b.readers = (3, 300), (1, 0)
    await b.tick(T0 + 1500)
    counts_a.grown, counts_a.readers = (4, 4000), (0, 0)
    await a.tick(T0 + 3000)  # 2 s later: its readers since then, in the same bucket
    # The next bucket: only a, with more appends; b stopped (its live readers go stale).
    counts_a.grown = (10, 100)
    await a.tick(T0 + 12_000)
    counts_a.grown = (7, 70)
    await a.tick(T0 + 21_000)  # the bucket under way: in the totals, not in the series

    bucket = await redis.hgetall(f"{tag}:b:{T0 // 1000}")
    assert {k: bucket[k] for k in (b"a", b"b", b"sse", b"lp")} == {
        b"a": b"12",
        b"b": b"4800",
        b"sse": str(2 * 2000 + 1 * 2000 + 0).encode(),  # readers x ms: a's first tick counts one interval
        b"lp": str(1 * 2000).encode(),
    }
    assert 0 < await redis.ttl(f"{tag}:b:{T0 // 1000}") <= stats.RETENTION_SECONDS

    reader = stats.Reader(scripts, tag)
    found = await reader.overview(minutes=1, now=T0 + 21_500)
    series = found["series"]
    assert len(series["start_ms"]) == 60 // stats.BUCKET_SECONDS
    assert series["start_ms"][-2:] == [T0, T0 + 10_000]
    assert series["appends_per_s"][-2:] == [1.2, 1.0]
    assert series["bytes_per_s"][-2:] == [480.0, 10.0]
    assert series["sse"][-2:] == [0.6, 0.0] and series["long_poll"][-2:] == [0.2, 0.0]
    assert series["appends_per_s"][:-2] == [None] * 4  # no process recorded then: no data, not zero
    assert found["totals"] == {"appends": 12 + 10 + 7, "bytes": 4800 + 100 + 70}
    assert found["now"]["appends_per_s"] == 1.0  # the last complete bucket
    # b last reported 20 s ago: not counted, and its entry is removed.
    assert found["processes"] == 1 and found["now"]["sse"] == 0
    assert await redis.hkeys(f"{tag}:live") == [b"gw-a"]


async def test_one_process_per_bucket_samples_archive_and_subscriptions(
    scripts: Scripts, tag: str, redis: aioredis.Redis
) -> None:
    await redis.zadd(f"{tag}:hints", {"s1": T0 - 4000, "s2": T0 + 60_000})
    a, _ = recorder(scripts, tag, "gw-a")
    b, _ = recorder(scripts, tag, "gw-b")
    await a.tick(T0 + 1000)
    bucket = f"{tag}:b:{T0 // 1000}"
    assert await redis.hget(bucket, "lag") == b"5000" and await redis.hget(bucket, "adue") == b"1"
    await redis.zadd(f"{tag}:hints", {"s0": T0 - 9000})  # an older hint
    await b.tick(T0 + 2000)  # not the bucket's sampler: b samples nothing
    assert await redis.hget(bucket, "lag") == b"5000"
    await a.tick(T0 + 3000)  # its sampler samples at each of its ticks in it: the last stays
    assert await redis.hget(bucket, "s") == b"gw-a"
    assert await redis.hget(bucket, "lag") == b"12000" and await redis.hget(bucket, "adue") == b"2"

    found = await stats.Reader(scripts, tag).overview(minutes=1, now=T0 + 4000)
    assert found["series"]["archive_lag_s"][-1] is None  # the bucket under way is not in the series
    archive, subscriptions = found["now"]["archive"], found["now"]["subscriptions"]
    assert archive["lag_seconds"] == 12.0 and archive["due_streams"] == 2
    assert isinstance(archive["workers"], bool)
    # Those are the real schedules of the test Redis, which other tests use too.
    assert subscriptions["backlog"] >= 0 and subscriptions["patterns"] >= 0 and subscriptions["outbox"] >= 0

    await b.tick(T0 + 11_000)  # the next bucket: b is first
    assert await redis.hget(f"{tag}:b:{T0 // 1000 + 10}", "s") == b"gw-b"
    found = await stats.Reader(scripts, tag).overview(minutes=1, now=T0 + 12_000)
    assert found["series"]["archive_lag_s"][-1] == 12.0  # the complete bucket: its last sample
    assert found["now"]["archive"]["lag_seconds"] == 20.0  # the bucket under way: b sampled it


async def test_readers_of_a_watched_stream_and_its_write_rate(
    scripts: Scripts, tag: str, redis: aioredis.Redis
) -> None:
    sid = keys.stream_id(f"chat/{uuid.uuid4().hex[:6]}:meta")  # ":meta": no key may end so
    local = {sid: 3}
    a = stats.Recorder(scripts, lambda s: local.get(s, 0), [], counters=SetCounters(), tag=tag)
    reader = stats.Reader(scripts, tag)
    await a.tick(T0)  # nothing watched: nothing reported
    assert not await redis.exists(f"{tag}:r:{sid.replace(':', '%3A')}")

    first = await reader.stream(sid, 100, now=T0 + 500)
    assert first["readers"] is None  # the gateways have not had a tick to count them yet
    assert first["bytes_per_s"] is None and first["series"] == {"at_ms": [], "bytes_per_s": []}
    await reader.stream(sid, 100, now=T0 + 800)  # the same second: the same sample
    assert not [k async for k in redis.scan_iter(match=f"{tag}*") if k.endswith(b":meta")]

    await a.tick(T0 + 2000)  # sees the watch, reports its readers
    found = await reader.stream(sid, 1100, now=T0 + 2500)
    assert found["readers"] == 3  # known as soon as a gateway reported some
    assert found["bytes_per_s"] == 500.0 and found["series"]["at_ms"] == [T0 + 2500]
    local[sid] = 0
    await a.tick(T0 + 4000)  # none any more: its entry goes
    found = await reader.stream(sid, 1100, now=T0 + 6500)
    assert found["readers"] == 0 and found["bytes_per_s"] == 0.0
    assert found["series"]["bytes_per_s"] == [500.0, 0.0]

    # A stream nobody asked about for WATCH_SECONDS is not counted any more.
    local[sid] = 5
    await a.tick(T0 + 6500 + int(stats.WATCH_SECONDS * 1000) + 1)
    assert await redis.hlen(f"{tag}:r:{sid.replace(':', '%3A')}") == 1  # only "_since"


async def test_the_watched_streams_are_bounded(scripts: Scripts, tag: str, redis: aioredis.Redis) -> None:
    reader = stats.Reader(scripts, tag)
    for i in range(stats.MAX_WATCHED + 5):
        await reader.stream(f"s{i}", 0, now=T0 + i)
    watched = await redis.zrange(f"{tag}:watched", 0, -1)
    assert len(watched) == stats.MAX_WATCHED and watched[-1] == f"s{stats.MAX_WATCHED + 4}".encode()


async def test_process_counters_are_taken_once(scripts: Scripts) -> None:
    """Two recorders of one process (two gateways in a test) share its counters: what one
    took, the other does not take again; what was never sent is given back."""
    from gateway.telemetry import metrics

    counters = stats.ProcessCounters()
    counters.start()
    metrics.APPENDS.inc(2)
    metrics.APPENDED_BYTES.inc(20)
    assert counters.take() == (2, 20) and counters.take() == (0, 0)
    counters.give_back(2, 20)
    assert counters.take() == (2, 20)


# -- over HTTP ----------------------------------------------------------------------------


async def eventually(check: Callable[[], Awaitable[Any]], what: str, seconds: float = 10.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.1)


async def get_json(http: aiohttp.ClientSession, url: str, **headers: str) -> Any:
    async with http.get(url, headers=headers) as r:
        assert r.status == 200, (r.status, await r.text())
        assert r.headers["Cache-Control"] == "no-store"
        return await r.json()


@contextlib.contextmanager
def gateway_process(redis_url: str, folder: Path) -> Iterator[str]:
    """``durable-streams serve`` in a process of its own: its streams' base URL."""
    port = free_port()
    folder.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--redis-url", redis_url, "--port", str(port)],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_ready(port, proc)
        yield f"http://127.0.0.1:{port}/v1/stream"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


@pytest.fixture
def fast_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "TICK_SECONDS", 0.2)


async def test_two_gateway_processes_answer_the_same(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Appends through two gateway processes, a live reader on one: both count them all."""
    with (
        gateway_process(own_redis.url, tmp_path / "a") as base_a,
        gateway_process(own_redis.url, tmp_path / "b") as base_b,
    ):
        async with http.put(f"{base_a}/chat/1", headers=TEXT) as r:
            assert r.status == 201
        for i, base in enumerate([base_a, base_b, base_a, base_b, base_b]):
            async with http.post(f"{base}/chat/1", data=b"x" * (i + 1), headers=TEXT) as r:
                assert r.status == 204

        async def counted() -> Any:
            found = await get_json(http, f"{base_a}/__ds/stats")
            return found if found["totals"] == {"appends": 5, "bytes": 15} else None

        await eventually(counted, "the appends of both gateways counted")
        for _ in range(5):  # the same, but for a bucket ending between the two requests
            one, other = (
                await get_json(http, f"{base_a}/__ds/stats"),
                await get_json(http, f"{base_b}/__ds/stats"),
            )
            if one["series"]["start_ms"] == other["series"]["start_ms"]:
                break
        assert one["series"] == other["series"] and one["totals"] == other["totals"]
        assert one["minutes"] == 15 and one["bucket_seconds"] == 10 and one["processes"] == 2

        # A live reader on b: counted in the overview and in the stream's readers, seen from a.
        sse = await http.get(f"{base_b}/chat/1", params={"offset": "now", "live": "sse"})
        try:

            async def live() -> Any:
                found = await get_json(http, f"{base_a}/__ds/stats")
                return found["now"]["sse"] == 1 and found["now"]["long_poll"] == 0

            await eventually(live, "the SSE reader on b counted by a")

            async def readers() -> Any:
                found = await get_json(http, f"{base_a}/__ds/stats/streams/chat/1")
                return found if found["readers"] == 1 else None

            found = await eventually(readers, "the stream's reader on b counted by a")
            assert found["path"] == "chat/1" and found["bytes"] == 15 and found["status"] == "open"
            other = await get_json(http, f"{base_b}/__ds/stats/streams/chat/1")
            assert other["readers"] == 1
        finally:
            sse.close()

        async with http.get(f"{base_a}/__ds/stats/streams/nothing/here") as r:
            assert r.status == 404
        async with http.get(f"{base_a}/__ds/stats", params={"minutes": "0"}) as r:
            assert r.status == 400
        found = await get_json(http, f"{base_a}/__ds/stats?minutes=60")
        assert len(found["series"]["start_ms"]) == 360


async def test_on_a_redis_cluster(redis_cluster: Any, http: aiohttp.ClientSession, monkeypatch) -> None:
    """On Redis Cluster: the statistics' keys on one slot, the samples read on every node
    (16 hint keys, 16 schedules), the outboxes (one per slot) left out."""
    monkeypatch.setattr(stats, "TICK_SECONDS", 0.2)
    run = uuid.uuid4().hex[:8]
    async with (
        serving(redis_cluster.seed_url, redis_cluster=True) as a,
        serving(redis_cluster.seed_url, redis_cluster=True) as b,
    ):
        names = [f"{run}/{n}" for n in range(6)]  # on several primaries
        for i, name in enumerate(names):
            async with http.put(f"{(a, b)[i % 2]}/{name}", data=b"abc", headers=TEXT) as r:
                assert r.status == 201
        config = {"type": "webhook", "pattern": f"{run}/*", "webhook": {"url": "https://93.184.215.14/h"}}
        async with http.put(f"{a}/__ds/subscriptions/{run}", json=config) as r:
            assert r.status == 201
        sse = await http.get(f"{b}/{names[0]}", params={"offset": "now", "live": "sse"})
        try:

            async def seen() -> Any:
                found = await get_json(http, f"{a}/__ds/stats")
                stream = await get_json(http, f"{a}/__ds/stats/streams/{names[0]}")
                sampled = (found["now"]["subscriptions"]["patterns"] or 0) >= 1
                return sampled and found["now"]["sse"] >= 1 and stream["readers"] == 1 and found

            found = await eventually(seen, "the cluster's figures")
        finally:
            sse.close()
        assert (
            found["now"]["subscriptions"]["outbox"] is None and found["now"]["subscriptions"]["patterns"] >= 1
        )
        assert found["now"]["archive"]["lag_seconds"] is not None
        subs = await get_json(http, f"{b}/__ds/stats/subscriptions")
        assert run in {s["id"] for s in subs["subscriptions"]} or subs["more"]


async def test_subscriptions_with_their_state(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession, fast_ticks: None
) -> None:
    async with serving(own_redis.url) as base:
        webhook = {"url": "https://93.184.215.14/h"}
        for sub, config in [
            ("orders", {"type": "webhook", "pattern": "orders/*", "webhook": webhook}),
            ("audit", {"type": "webhook", "streams": ["audit/log"], "webhook": webhook}),
            ("quiet", {"type": "webhook", "streams": ["quiet/log"], "webhook": webhook}),
        ]:
            async with http.put(f"{base}/__ds/subscriptions/{sub}", json=config) as r:
                assert r.status == 201, await r.text()
        # As the delivery worker's schedule holds a subscription with a wake due.
        client = aioredis.Redis.from_url(own_redis.url)
        await client.zadd(keys.due_key(0), {"audit": int(time.time() * 1000) - 1000})

        found = await get_json(http, f"{base}/__ds/stats/subscriptions")
        # A new pattern subscription is due too: a worker links the streams it matches.
        assert found["patterns"] == 1 and found["scheduled"] == 2 and found["due"] == 2
        assert not found["more"]
        shown = {s["id"]: s for s in found["subscriptions"]}
        assert set(shown) == {"audit", "orders"}  # one never scheduled is in no index (docs/console.md)
        assert shown["orders"]["state"] == "due" and shown["orders"]["backfill"]
        assert shown["orders"]["pattern"] == "orders/*" and shown["orders"]["streams"] == 0
        assert shown["audit"] == {
            **shown["audit"],
            "type": "webhook",
            "state": "due",
            "pattern": None,
            "streams": 1,
            "pending_streams": 0,
            "attempts": 0,
            "backfill": False,
        }

        # Its wake done (out of the schedule): still listed, idle, for the hour after.
        async def remembered() -> bool:
            return bool(await client.zscore(stats.StatsKeys().seen_subscriptions, "audit"))

        await eventually(remembered, "the gateway's samples remember it")
        await client.zrem(keys.due_key(0), "audit")
        found = await get_json(http, f"{base}/__ds/stats/subscriptions")
        shown = {s["id"]: s for s in found["subscriptions"]}
        assert set(shown) == {"audit", "orders"} and shown["audit"]["state"] == "idle"
        async with http.delete(f"{base}/__ds/subscriptions/audit") as r:
            assert r.status in (200, 204)
        found = await get_json(http, f"{base}/__ds/stats/subscriptions")
        assert [s["id"] for s in found["subscriptions"]] == ["orders"]
        assert await client.zscore(stats.StatsKeys().seen_subscriptions, "audit") is None  # forgotten
        await client.aclose()


def _tokens(folder: Path, run: str) -> dict[str, str]:
    tokens = {name: f"stats-{name}-{run}" for name in ("user", "reader", "admin")}
    entries = [
        {
            "name": "user",
            "token": tokens["user"],
            "grants": f"write:{run}/ read:__ds/subscriptions/{run}-mine",
        },
        {"name": "reader", "token": tokens["reader"], "grants": "read:*"},
        {"name": "admin", "token": tokens["admin"], "grants": "admin:*"},
    ]
    (folder / "tokens.json").write_text(json.dumps({"tokens": entries}))
    (folder / "signing.key").write_text("k" * 48)
    return tokens


async def test_access_control(own_redis: EmbeddedRedis, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    run = f"stats-{uuid.uuid4().hex[:8]}"
    tokens = _tokens(tmp_path, run)
    settings = {
        "auth_tokens_file": str(tmp_path / "tokens.json"),
        "auth_signing_key_file": str(tmp_path / "signing.key"),
    }
    user, reader, admin = ({"Authorization": f"Bearer {tokens[n]}"} for n in ("user", "reader", "admin"))
    async with serving(own_redis.url, **settings) as base:
        async with http.put(f"{base}/{run}/a", headers={**TEXT, **user}) as r:
            assert r.status == 201
        # The overview sums every stream: it needs read on all of them.
        for headers, status in [({}, 401), (user, 403), (reader, 200)]:
            async with http.get(f"{base}/__ds/stats", headers=headers) as r:
                assert r.status == status, (headers, await r.text())
        # One stream: read on it.
        for headers, status in [({}, 401), (user, 200), (reader, 200)]:
            async with http.get(f"{base}/__ds/stats/streams/{run}/a", headers=headers) as r:
                assert r.status == status, (headers, await r.text())
        # Subscriptions: those the credential may read.
        config = {"type": "webhook", "pattern": f"{run}/*", "webhook": {"url": "https://93.184.215.14/h"}}
        for sub in (f"{run}-mine", f"{run}-other"):
            async with http.put(f"{base}/__ds/subscriptions/{sub}", json=config, headers=admin) as r:
                assert r.status == 201, await r.text()
        async with http.get(f"{base}/__ds/stats/subscriptions") as r:
            assert r.status == 401
        listed = [
            [
                s["id"]
                for s in (await get_json(http, f"{base}/__ds/stats/subscriptions", **who))["subscriptions"]
            ]
            for who in (user, reader)
        ]
        assert listed == [[f"{run}-mine"], [f"{run}-mine", f"{run}-other"]]


async def test_off_with_the_console(redis_url: str, http: aiohttp.ClientSession) -> None:
    async with serving(redis_url, console="off") as base:
        async with http.get(f"{base}/__ds/stats") as r:
            assert r.status == 404
