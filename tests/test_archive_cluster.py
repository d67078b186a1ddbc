"""The archive worker on a Redis Cluster: hints, leases and reconciliation across
every primary, and a worker that goes on through a failover.

Streams are picked so that each primary serves some (their hash tag's slot); a
gateway with ``redis_cluster=True`` writes and reads them, workers (``Archiver``
on a ``RedisCluster`` and routed scripts) archive them into one archive directory
shared by this module's tests (a worker takes any due hint, whichever test's).
Every wait is bounded and generous; the cluster is whole again after each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import RedisCluster
from redis.crc import key_slot

from gateway.archive.files import Archive
from gateway.archive.segments import Segment
from gateway.features.hints import HintKeys
from gateway.protocol import offsets
from gateway.redis_io import keys
from gateway.redis_io.scripts import connect_scripts, replica_ack
from workers.archiver import Archiver, Policy, now_ms
from workers.compactor import CompactionPolicy

from .cluster import Cluster, Node
from .conftest import read_all, start_gateway, terminate
from .test_archive import check_once, transcript

OCTET = {"Content-Type": "application/octet-stream"}
# Everything but the last 100 bytes of a stream is due at once; no merges (min_bytes 0).
WINDOW = Policy(hot_bytes=100, hot_ms=0, min_bytes=0, max_delay_ms=0, file_bytes=1 << 20, row_group_bytes=40)
HINTS = HintKeys(cluster=True)
RECOVER_SECONDS = 60.0  # a failover, a worker's backoff (at most 10 s), a round


@pytest.fixture
def cluster(redis_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster, whole again after each test (roles may have moved)."""
    yield redis_cluster
    redis_cluster.heal(60)


@pytest.fixture(scope="module")
def cluster_archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cluster-archive"))


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[RedisCluster]:
    redis = RedisCluster.from_url(cluster.seed_url)
    yield redis
    await redis.aclose()


@contextlib.asynccontextmanager
async def gateway_on(cluster: Cluster, archive_dir: str, **settings: Any) -> AsyncIterator[str]:
    """A gateway on the cluster (reading archived data from ``archive_dir``): its stream URL base."""
    server = await start_gateway(cluster.seed_url, redis_cluster=True, archive_url=archive_dir, **settings)
    try:
        yield str(server.make_url("/v1/stream"))
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def worker_on(
    cluster: Cluster, archive_dir: str, policy: Policy = WINDOW, *, replicas: int = 0, **options: Any
) -> AsyncIterator[Archiver]:
    """An archive worker on the cluster, as ``run_worker`` builds one."""
    redis = RedisCluster.from_url(cluster.seed_url)
    ack = replica_ack(replicas, 2.0)
    scripts = connect_scripts(cluster.seed_url, cluster=True, max_connections=8, timeout=10, replica_ack=ack)
    try:
        yield Archiver(redis, Archive(archive_dir), policy, scripts=scripts, **options)
    finally:
        await scripts.aclose()
        await redis.aclose()


def slot_of(sid: str) -> int:
    return key_slot(keys.stream_keys(sid)[0].encode())


def sids_on(cluster: Cluster, name: str, per_node: int, hints_there: bool = False) -> dict[Node, list[str]]:
    """Fresh stream ids (= paths), ``per_node`` on each primary (by their slot); with
    ``hints_there``, only streams whose hint key is on the same primary."""
    tag = uuid.uuid4().hex[:8]
    out: dict[Node, list[str]] = {p: [] for p in cluster.primaries}
    owners: dict[int, Node] = {}
    for i in range(10_000):
        sid = f"{name}-{tag}-{i}"
        slot = slot_of(sid)
        owner = owners.get(slot) or owners.setdefault(slot, cluster.slot_owner(slot))
        if len(out[owner]) >= per_node:
            continue
        if hints_there and cluster.primary_of(HINTS.of(sid)) is not owner:
            continue
        out[owner].append(sid)
        if all(len(found) == per_node for found in out.values()):
            return out
    raise AssertionError(f"not {per_node} streams on every primary: {out}")


def every_sid(spread: dict[Node, list[str]]) -> list[str]:
    return [sid for sids in spread.values() for sid in sids]


async def fill(http: aiohttp.ClientSession, base: str, sid: str, bodies: int = 10) -> bytes:
    """Create the stream and append ``bodies`` random bodies; what it holds."""
    url = f"{base}/{sid}"
    async with http.put(url, headers=OCTET) as r:
        assert r.status == 201, await r.text()
    data = b""
    for _ in range(bodies):
        body = os.urandom(50)
        async with http.post(url, data=body, headers=OCTET) as r:
            assert r.status == 204, await r.text()
        data += body
    return data


async def meta_of(redis: RedisCluster, sid: str) -> dict[str, str]:
    raw = await redis.hgetall(keys.stream_keys(sid)[0])
    return {k.decode(): v.decode() for k, v in raw.items()}


async def segments_of(redis: RedisCluster, sid: str) -> list[Segment]:
    """The stream's committed segments (none without an incarnation)."""
    inc = (await meta_of(redis, sid)).get("inc")
    if not inc:
        return []
    return [Segment.parse(m) for m in await redis.zrangebyscore(keys.segments(sid, inc), 0, "+inf")]


async def eventually(check: Callable[[], Awaitable[object]], what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    last: object = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: not after {seconds:.0f} s (last: {last!r})")


# -- (a) streams on every primary are archived, reads unchanged ---------------------------------


async def test_streams_on_every_primary_are_archived(cluster, client, cluster_archive, http):
    spread = sids_on(cluster, "spread", 2)
    async with gateway_on(cluster, cluster_archive, max_chunk_bytes=64) as base:
        data = {sid: await fill(http, base, sid) for sid in every_sid(spread)}
        probes = [0, 1, 49, 50, 123, 250, 399, 400, 401, 499]  # across files, the window's edge, the tail
        before = {}
        for sid in data:
            before[sid] = (
                await transcript(http, f"{base}/{sid}"),
                [await transcript(http, f"{base}/{sid}", offsets.encode(p)) for p in probes],
            )

        async with worker_on(cluster, cluster_archive) as worker:
            await worker.drain()  # found by reconciliation alone: no worker was announced before
            assert worker.files_written >= len(data)

        for node, sids in spread.items():
            for sid in sids:
                meta = await meta_of(client, sid)
                start = int(meta["arch"])
                assert start >= len(data[sid]) - WINDOW.hot_bytes - 50, (node, meta)  # all but the window
                log = await client.xrange(keys.stream_keys(sid)[1], count=1)
                assert int(log[0][0].split(b"-")[0]) >= start  # below it, nothing is in Redis
                segments = await segments_of(client, sid)
                assert segments and segments[0].start == 0 and segments[-1].end == start
                assert all((Path(cluster_archive) / s.file).exists() for s in segments)
                await check_once(client, Archive(cluster_archive), sid, data[sid])
                # Byte for byte and header for header, whatever the read's start: the part below
                # the window now comes from Parquet.
                after = (
                    await transcript(http, f"{base}/{sid}"),
                    [await transcript(http, f"{base}/{sid}", offsets.encode(p)) for p in probes],
                )
                assert after == before[sid], (node, sid)
                assert b"".join(t[2] for t in after[0]) == data[sid]


async def test_state_compaction_on_every_primary(cluster, client, cluster_archive, http):
    """Compacted streams on every primary: runs drop in Redis and replace archived segments
    (a deep run), fenced by scripts routed to each stream's primary; reads are what a fold of
    the whole history keeps."""
    spread = sids_on(cluster, "compacted", 1)
    policy = CompactionPolicy(lag_ms=0, lag_bytes=0, tombstone_ms=3_600_000, min_interval_ms=0, dirty_ratio=0)
    versions = [
        {"type": "t", "key": f"k{n % 4}", "value": {"v": n}, "headers": {"operation": "upsert"}}
        for n in range(40)
    ]
    json = {"Content-Type": "application/json"}
    async with (
        gateway_on(cluster, cluster_archive) as base,
        worker_on(
            cluster, cluster_archive, dataclasses.replace(WINDOW, hot_bytes=0), compaction=policy
        ) as worker,
    ):
        for sid in every_sid(spread):
            url = f"{base}/{sid}"
            async with http.put(url, headers={**json, "Stream-Compaction": "state"}) as r:
                assert r.status == 201, await r.text()
            for part in (versions[:20], versions[20:]):  # archived, then made redundant
                async with http.post(url, data=orjson.dumps(part), headers=json) as r:
                    assert r.status in (200, 204), await r.text()
                await worker.archive_stream(sid)
            meta = await meta_of(client, sid)
            assert int(meta["arch"]) > 0 and int(meta["cdropn"]) == 36 and meta["cac"], meta
            async with http.get(url, params={"offset": "-1"}) as r:
                got = orjson.loads(await r.read())
            for item in got:  # (State messages are read with their offsets: headers.offset)
                item["headers"].pop("offset", None)
            assert got == versions[-4:], sid


async def test_the_archive_command_on_a_cluster(cluster, client, cluster_archive, http, tmp_path):
    """``durable-streams archive --redis-cluster``, a process, archives streams on every primary."""
    sids = every_sid(sids_on(cluster, "command", 1))
    command = [sys.executable, "-m", "gateway", "archive", "--redis-url", cluster.seed_url, "--redis-cluster",
               "--archive-url", cluster_archive, "--archive-hot-bytes", "100", "--archive-hot-seconds", "0",
               "--archive-min-bytes", "0", "--archive-max-delay", "0", "--archive-interval", "0.05",
               "--log-level", "warning"]  # fmt: skip
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        async with gateway_on(cluster, cluster_archive) as base:
            data = {sid: await fill(http, base, sid) for sid in sids}

            async def archived() -> bool:
                assert worker.poll() is None, (tmp_path / "worker.log").read_text()
                starts = {sid: int((await meta_of(client, sid)).get("arch") or 0) for sid in sids}
                return all(start >= len(data[sid]) - WINDOW.hot_bytes - 50 for sid, start in starts.items())

            await eventually(archived, "every stream archived by the worker process", RECOVER_SECONDS)
            for sid in sids:
                await check_once(client, Archive(cluster_archive), sid, data[sid])
                assert await read_all(http, f"{base}/{sid}") == data[sid]
    finally:
        terminate(worker, 30)
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()


# -- (b) hints are spread over the primaries ----------------------------------------------------


def test_hint_keys_spread_over_every_primary(cluster):
    """On a cluster, 16 hint keys in 16 slots, one in each sixteenth of the slots, so every
    primary of an even split holds some; on one Redis, the one key of always."""
    assert len(HINTS.all) == keys.ARCHIVE_HINT_SHARDS == len(set(HINTS.all))
    slots = [key_slot(k.encode()) for k in HINTS.all]
    assert [s * keys.ARCHIVE_HINT_SHARDS // 16384 for s in slots] == list(range(keys.ARCHIVE_HINT_SHARDS))
    assert {cluster.primary_of(k) for k in HINTS.all} == set(cluster.primaries)
    assert keys.ARCHIVE_HINTS not in HINTS.all
    assert HintKeys(cluster=False).all == (keys.ARCHIVE_HINTS,)
    assert HintKeys(cluster=False).of("any") == keys.ARCHIVE_HINTS
    # A stream's hint key is in its own sixteenth of the slots: stable, and mostly on its node.
    for sid in (f"s-{i}" for i in range(200)):
        assert key_slot(HINTS.of(sid).encode()) // 1024 == slot_of(sid) // 1024


async def test_hints_land_on_every_primary_and_workers_take_them(cluster, client, cluster_archive, http):
    await client.set(keys.ARCHIVE_WORKER_ALIVE, "test", px=60_000)  # what a running worker says
    spread = sids_on(cluster, "hinted", 3, hints_there=True)
    sids = every_sid(spread)
    async with gateway_on(cluster, cluster_archive) as base:
        for sid in sids:
            await fill(http, base, sid, bodies=5)

        async def all_hinted() -> bool:
            return all([await client.zscore(HINTS.of(sid), sid) is not None for sid in sids])

        await eventually(all_hinted, "every stream hinted in its key")
        used = {HINTS.of(sid) for sid in sids}
        holders = {cluster.primary_of(key) for key in used}
        assert holders == set(cluster.primaries), "hints not on every primary"
        for sid in sids:
            assert await client.zscore(keys.ARCHIVE_HINTS, sid) is None  # not the one-Redis key

        # A deleted stream's hint goes with it (the gateway's Hints.forget, in the stream's key).
        gone = spread[cluster.primaries[0]][0]
        async with http.delete(f"{base}/{gone}") as r:
            assert r.status == 204
        assert await client.zscore(HINTS.of(gone), gone) is None
        sids.remove(gone)

        async with worker_on(cluster, cluster_archive) as one, worker_on(cluster, cluster_archive) as two:
            # The backlog metrics count every key's hints.
            due = await one.finder.report_backlog(now_ms())
            assert sum(due.values()) >= len(sids) and set(due) == set(HINTS.all)
            assert REGISTRY.get_sample_value("ds_archive_due_streams") == sum(due.values())
            # Passes start at a different key each time: over 16 passes, at every key.
            assert {two.finder.polling_order()[0] for _ in HINTS.all} == set(HINTS.all)
            taken = await asyncio.gather(one.work_once(limit=1000), two.work_once(limit=1000))
            assert sum(taken) >= len(sids)
        for sid in sids:
            assert await client.zscore(HINTS.of(sid), sid) is None, sid
            assert await segments_of(client, sid), f"{sid} not archived"


# -- (c) reconciliation covers every primary ----------------------------------------------------


async def test_reconciliation_covers_every_primary(cluster, client, cluster_archive, http):
    """Streams whose hints were lost are found on every primary; the archives of deleted
    streams on every primary are removed, indexed or not (an upgrade's: found by SCAN)."""
    await client.delete(keys.ARCHIVE_WORKER_ALIVE)  # no worker: gateways send no hints
    spread = sids_on(cluster, "reconciled", 3)
    sids = every_sid(spread)
    async with gateway_on(cluster, cluster_archive) as base:
        data = {sid: await fill(http, base, sid, bodies=6) for sid in sids}
        for sid in sids:
            await client.zrem(HINTS.of(sid), sid)  # lost, had one been sent

        async with worker_on(cluster, cluster_archive) as worker:
            assert await worker.reconcile(force=True)
            for sid in sids:
                assert await client.zscore(HINTS.of(sid), sid) is not None, f"{sid} not found"
            while await worker.work_once(limit=1000):
                pass
        files = {}
        for sid in sids:
            files[sid] = [Path(cluster_archive) / s.file for s in await segments_of(client, sid)]
            assert files[sid] and all(f.exists() for f in files[sid]), sid
            await check_once(client, Archive(cluster_archive), sid, data[sid])

        # On every primary: one stream kept, one deleted (indexed), one deleted and unindexed.
        kept, indexed, unindexed = ([spread[p][i] for p in spread] for i in range(3))
        for sid in unindexed:
            inc = (await meta_of(client, sid))["inc"]
            assert await client.srem(keys.ARCHIVE_SEGSETS, keys.segments(sid, inc)) == 1
        for sid in indexed + unindexed:
            async with http.delete(f"{base}/{sid}") as r:
                assert r.status == 204
        async with worker_on(cluster, cluster_archive) as fresh:  # a new worker: indexes what SCAN finds
            assert await fresh.reconcile(force=True)
        for sid in indexed + unindexed:
            assert not any(f.exists() for f in files[sid]), f"files of {sid} left"
            found = [k async for k in client.scan_iter(match=keys.segments(sid, "*"))]
            assert not found, found
        index = {m.decode() for m in await client.smembers(keys.ARCHIVE_SEGSETS)}
        for sid in sids:
            named = [k for k in index if keys.split_segments_key(k)[0] == sid]
            assert len(named) == (sid in kept), sid
        for sid in kept:
            assert all(f.exists() for f in files[sid])
            assert await read_all(http, f"{base}/{sid}") == data[sid]


# -- (d) through a failover ---------------------------------------------------------------------


class Writer:
    """Appends random bodies to one stream as an idempotent producer, each retried (same
    sequence number) until acknowledged: what it holds is exactly what was acknowledged."""

    def __init__(self, http: aiohttp.ClientSession, url: str, seed: int) -> None:
        self.http, self.url, self.rng = http, url, random.Random(seed)
        self.written = bytearray()
        self.seq = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            body = self.rng.randbytes(self.rng.randint(1, 80))
            await self._append(body)
            self.written += body
            await asyncio.sleep(0.01)

    async def _append(self, body: bytes) -> None:
        headers = {**OCTET, "Producer-Id": "writer", "Producer-Epoch": "0", "Producer-Seq": str(self.seq)}
        deadline = time.monotonic() + RECOVER_SECONDS
        last: object = None
        while time.monotonic() < deadline:
            try:
                async with self.http.post(self.url, data=body, headers=headers) as r:
                    if r.status in (200, 204):
                        self.seq += 1
                        return
                    last = (r.status, await r.text())
                    assert r.status in (503, 504), last  # Redis away (or a write unconfirmed): nothing else
            except aiohttp.ClientError as exc:
                last = exc
            await asyncio.sleep(0.1)
        raise AssertionError(f"append to {self.url} not acknowledged in {RECOVER_SECONDS:.0f} s: {last!r}")


async def settle(worker: Archiver, redis: RedisCluster, sids: list[str]) -> None:
    """Until no stream has a staged or garbage segment left (a lease of the stopped worker
    may still be held for a moment: a busy stream is tried again)."""

    async def clean() -> bool:
        for sid in sids:
            inc = (await meta_of(redis, sid)).get("inc")
            if inc and await redis.zcount(keys.segments(sid, inc), "-inf", "(0"):
                await worker.archive_stream(sid)
                return False
        return True

    await eventually(clean, "no staged or garbage segment left", RECOVER_SECONDS)


@pytest.mark.parametrize("fault", ["failover", "kill"])
async def test_a_worker_goes_on_through_a_failover(cluster, client, cluster_archive, http, fault):
    """Writers append to streams on every primary while a worker archives them; one primary
    fails over (coordinated, or killed: then writes wait for a replica, --min-replicas-ack 1,
    so that an acknowledged write survives it). The worker goes on archiving that
    primary's streams afterwards; at the end every acknowledged byte is read back, and
    the files plus Redis hold each byte once, with no stray file."""
    spread = sids_on(cluster, f"through-{fault}", 2)
    sids = every_sid(spread)
    # Not the seed node (clients here find the cluster through it), and one that holds streams.
    target = next(p for p in spread if p.port != cluster.nodes[0].port)
    replicas = 1 if fault == "kill" else 0
    policy = dataclasses.replace(WINDOW, hot_bytes=200, file_bytes=2000)
    stop_writing, stop_working = asyncio.Event(), asyncio.Event()
    gateway = gateway_on(cluster, cluster_archive, min_replicas_ack=replicas, min_replicas_ack_timeout=2.0)
    options = {"interval": 0.05, "reconcile_seconds": 5, "lease_seconds": 3}
    working_on = worker_on(cluster, cluster_archive, policy, replicas=replicas, **options)
    async with gateway as base, working_on as worker:
        writers = {sid: Writer(http, f"{base}/{sid}", seed) for seed, sid in enumerate(sids)}
        for sid in sids:
            async with http.put(f"{base}/{sid}", headers=OCTET) as r:
                assert r.status == 201
        working = asyncio.create_task(worker.run(stop_working))
        writing = [asyncio.create_task(w.run(stop_writing)) for w in writers.values()]
        try:

            async def files_on_target() -> int:
                return sum([len(await segments_of(client, sid)) for sid in spread[target]])

            await eventually(files_on_target, "the worker archives the target's streams", RECOVER_SECONDS)
            if fault == "failover":
                await asyncio.to_thread(cluster.failover, cluster.replica_of(target), RECOVER_SECONDS)
            else:
                await asyncio.to_thread(cluster.kill, target)
                await asyncio.to_thread(cluster.wait_healthy, RECOVER_SECONDS)  # the replica took over
                await asyncio.to_thread(cluster.heal, RECOVER_SECONDS)  # the old primary back, a replica
            assert target.role == "replica"
            files_then = await files_on_target()
            written_then = {sid: len(w.written) for sid, w in writers.items()}

            async def archived_since() -> bool:
                moved_on = all(len(w.written) > written_then[sid] + 2 * policy.hot_bytes
                               for sid, w in writers.items())  # fmt: skip
                return moved_on and await files_on_target() > files_then

            await eventually(archived_since, "new files of the failed-over streams", RECOVER_SECONDS)
        finally:
            stop_writing.set()
            await asyncio.wait_for(asyncio.gather(*writing), RECOVER_SECONDS)
            stop_working.set()
            await asyncio.wait_for(working, RECOVER_SECONDS)
        await settle(worker, client, sids)

        for sid, w in writers.items():
            assert w.written, sid
            assert await read_all(http, f"{base}/{sid}") == bytes(w.written), sid
            await check_once(client, Archive(cluster_archive), sid, bytes(w.written))


def test_a_bug_is_not_taken_for_redis_being_away() -> None:
    """Cross-slot keys are a bug to see (a traceback), not an outage to wait out."""
    from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError

    from workers.archiver import unavailable

    assert not unavailable(RedisClusterException("SADD - all keys must map to the same key slot"))
    assert unavailable(ClusterDownError("CLUSTERDOWN The cluster is down"))
    assert unavailable(TryAgainError("TRYAGAIN"))
    away = RedisClusterException("Redis Cluster cannot be connected")
    away.__cause__ = ConnectionError("refused")
    assert unavailable(away)


def test_hint_key_names_are_pinned() -> None:
    """Renaming the hint keys strands the hints in the old ones (until reconciliation) and
    splits gateways and workers of two versions during a rollout: a layout change."""
    assert keys.archive_hint_keys(False) == ["ds:archive:hints"]
    assert keys.archive_hint_keys(True) == [
        "ds:archive:hints:{0.13}", "ds:archive:hints:{1.10}", "ds:archive:hints:{2.3}",
        "ds:archive:hints:{3.0}", "ds:archive:hints:{4.63}", "ds:archive:hints:{5.60}",
        "ds:archive:hints:{6.43}", "ds:archive:hints:{7.40}", "ds:archive:hints:{8.20}",
        "ds:archive:hints:{9.23}", "ds:archive:hints:{10.40}", "ds:archive:hints:{11.43}",
        "ds:archive:hints:{12.1}", "ds:archive:hints:{13.2}", "ds:archive:hints:{14.23}",
        "ds:archive:hints:{15.20}",
    ]  # fmt: skip
