"""The gateway on a real Redis Cluster (tests/cluster.py: 3 primaries, 3 replicas on
loopback): streams on every shard, two gateways, a slot moved under writers and live
readers, and failovers with and without ``--min-replicas-ack``.

The histories checked: every acknowledged append is in its stream exactly once, in
its writer's order; an append whose outcome was unknown (504) is there at most
once; every live reader receives every byte once, in order, and none is left
waiting. Cluster operations block, so they run in threads while the gateways
(in this process) go on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from redis.crc import key_slot

from gateway.redis_io import keys
from gateway.telemetry import metrics

from .cluster import Cluster
from .conftest import read_all, serving
from .test_live import sse_events

TEXT = {"Content-Type": "text/plain"}
CATCH_UP_SECONDS = 30.0  # how long a live reader may take to see the last append


async def caught_up(readers: list[asyncio.Task[bytes]], names: list[str]) -> list[bytes]:
    """The readers' results, once all caught up; a stuck one fails the test, named."""
    _, pending = await asyncio.wait(readers, timeout=CATCH_UP_SECONDS)
    for task in pending:
        task.cancel()
    half = len(names) // 2  # SSE readers first, then long-poll ones
    pairs = enumerate(zip(readers, names, strict=True))
    stuck = [f"{name} ({'sse' if i < half else 'long-poll'})" for i, (task, name) in pairs if task in pending]
    assert not stuck, f"live readers stuck: {stuck}"
    return [task.result() for task in readers]


def retries(reason: str) -> float:
    """The gateways' (this process') count of cluster calls sent again for ``reason``."""
    return metrics.REDIS_RETRIES.labels(reason)._value.get()


@pytest.fixture
def cluster(redis_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster, whole again after each test."""
    yield redis_cluster
    redis_cluster.heal()


@contextlib.asynccontextmanager
async def gateways(cluster: Cluster, count: int = 1, **settings: object) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serving(cluster.seed_url, redis_cluster=True, **settings))
               for _ in range(count)]  # fmt: skip


def names_on_each_primary(cluster: Cluster, per_primary: int = 1, prefix: str = "c") -> list[str]:
    """Stream names whose keys live on each primary, ``per_primary`` of each."""
    found: dict[int, list[str]] = {p.port: [] for p in cluster.primaries}
    while any(len(v) < per_primary for v in found.values()):
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        owner = cluster.primary_of(keys.stream_keys(keys.stream_id(name))[0])
        if len(found[owner.port]) < per_primary:
            found[owner.port].append(name)
    return [n for names in found.values() for n in names]


def slot_of(name: str) -> int:
    return key_slot(keys.stream_keys(keys.stream_id(name))[0].encode())


@dataclass
class History:
    """What writers were told, per stream: records acknowledged, and records whose
    outcome is unknown (a 504 or a dropped connection)."""

    acked: dict[str, list[str]] = field(default_factory=dict)
    unknown: dict[str, set[str]] = field(default_factory=dict)

    def check(self, stream: str, content: bytes) -> None:
        records = [r for r in content.decode().split(";") if r]
        assert len(records) == len(set(records)), f"{stream}: a record is there twice"
        present = set(records)
        acked = self.acked.get(stream, [])
        lost = [r for r in acked if r not in present]
        assert not lost, f"{stream}: acknowledged appends lost: {lost[:5]} ({len(lost)})"
        unexplained = present - set(acked) - self.unknown.get(stream, set())
        assert not unexplained, f"{stream}: records nobody wrote: {sorted(unexplained)[:5]}"
        order = [r for r in records if r in set(acked)]
        for writer in {r.split(".")[0] for r in acked}:  # each writer's records in its order
            mine = [r for r in order if r.startswith(writer + ".")]
            assert mine == [r for r in acked if r.startswith(writer + ".")], f"{stream}: {writer} reordered"


async def writer(
    http: aiohttp.ClientSession, url: str, stream: str, who: str, history: History, stop: asyncio.Event
) -> None:
    """Appends ``<who>.<n>;`` one after another until ``stop``; 503 (not stored) is retried."""
    n = 0
    while not stop.is_set():
        record = f"{who}.{n}"
        try:
            async with http.post(f"{url}/{stream}", data=f"{record};", headers=TEXT) as r:
                status = r.status
        except aiohttp.ClientError:
            status = 0
        if status in (200, 204):
            history.acked.setdefault(stream, []).append(record)
            n += 1
        elif status == 503:
            await asyncio.sleep(0.02)  # nothing stored: the same record again
        else:
            assert status in (0, 504), f"append answered {status}"
            history.unknown.setdefault(stream, set()).add(record)
            n += 1
        await asyncio.sleep(0)


async def tail_long_poll(http: aiohttp.ClientSession, url: str, until: asyncio.Future[int]) -> bytes:
    """Everything from the start by long-poll, until the stream's final length is known and read."""
    data, offset = b"", "-1"
    while not (until.done() and len(data) >= until.result()):
        async with http.get(url, params={"offset": offset, "live": "long-poll"}) as r:
            assert r.status in (200, 204), r.status
            if r.status == 200:
                data += await r.read()
            offset = r.headers["Stream-Next-Offset"]
    return data


async def tail_sse(http: aiohttp.ClientSession, url: str, until: asyncio.Future[int]) -> bytes:
    """Everything from the start by SSE (reconnecting from the last offset when a response ends)."""
    data, offset = b"", "-1"
    while not (until.done() and len(data) >= until.result()):
        async with http.get(url, params={"offset": offset, "live": "sse"}) as r:
            assert r.status == 200, r.status
            async for kind, payload in sse_events(r):
                if kind == "data":
                    data += payload.encode()
                elif kind == "control":
                    offset = json.loads(payload).get("streamNextOffset", offset)
                if until.done() and len(data) >= until.result():
                    break  # checked at heartbeats too: they come each second when idle
    return data


async def test_streams_on_every_shard_two_gateways_and_live_readers(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Writers on one gateway, SSE and long-poll readers on the other, a stream on each
    primary; batches span slots (one process appends to all three at once)."""
    names = names_on_each_primary(cluster, per_primary=2)
    async with gateways(cluster, 2) as (a, b):
        for name in names:
            async with http.put(f"{a}/{name}", headers=TEXT) as r:
                assert r.status == 201
        final: dict[str, asyncio.Future[int]] = {n: asyncio.get_running_loop().create_future() for n in names}
        readers = [asyncio.create_task(tail_sse(http, f"{b}/{n}", final[n])) for n in names]
        readers += [asyncio.create_task(tail_long_poll(http, f"{b}/{n}", final[n])) for n in names]
        history, stop = History(), asyncio.Event()
        writers = [
            asyncio.create_task(writer(http, a, n, f"w{i}", history, stop)) for n in names for i in range(3)
        ]
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*writers)
        contents = {n: await read_all(http, f"{b}/{n}") for n in names}
        for n in names:
            history.check(n, contents[n])
            assert history.acked[n], f"{n}: nothing was appended"
            final[n].set_result(len(contents[n]))
        seen = await caught_up(readers, names + names)
        for got, n in zip(seen, names + names, strict=True):
            assert got == contents[n], f"{n}: a live reader saw other bytes than the stream holds"
    # The notices went out on the streams' own shards (sharded pub/sub), not to every node.
    for primary in cluster.primaries:
        with cluster.connect(primary) as c:
            stats = c.info("commandstats")
        assert stats.get("cmdstat_spublish", {}).get("calls", 0) > 0, f"{primary} published nothing sharded"


async def test_forks_across_slots(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    """A fork on another primary than its source reads what it inherited; deleting the
    source soft-deletes it while the fork reads; deleting the fork then collects it."""
    source, fork = names_on_each_primary(cluster, prefix="fork")[:2]
    assert cluster.primary_of(keys.stream_keys(keys.stream_id(source))[0]) is not cluster.primary_of(
        keys.stream_keys(keys.stream_id(fork))[0]
    )
    async with gateways(cluster) as (gw,):
        async with http.put(f"{gw}/{source}", data=b"inherited;", headers=TEXT) as r:
            assert r.status == 201
        async with http.put(
            f"{gw}/{fork}", headers={**TEXT, "Stream-Forked-From": f"/v1/stream/{source}"}
        ) as r:
            assert r.status == 201, await r.text()
        async with http.post(f"{gw}/{fork}", data=b"own;", headers=TEXT) as r:
            assert r.status in (200, 204)
        assert await read_all(http, f"{gw}/{fork}") == b"inherited;own;"
        async with http.delete(f"{gw}/{source}") as r:
            assert r.status in (200, 204)
        async with http.get(f"{gw}/{source}", params={"offset": "-1"}) as r:
            assert r.status in (404, 410)
        assert await read_all(http, f"{gw}/{fork}") == b"inherited;own;"  # the source's data is held
        async with http.delete(f"{gw}/{fork}") as r:
            assert r.status in (200, 204)
    with cluster.client() as client:  # the last fork gone, the soft-deleted source is collected
        assert not client.exists(keys.stream_keys(keys.stream_id(source))[0])


async def test_resharding_hot_streams_under_writers_and_live_readers(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The slots of hot streams move to other primaries while writers append and SSE and
    long-poll readers tail them: no acknowledged append lost or duplicated, no reader
    stuck, and afterwards the streams are served by their new owners."""
    names = names_on_each_primary(cluster, per_primary=1, prefix="hot")
    async with gateways(cluster, 2) as (a, b):
        for name in names:
            async with http.put(f"{a}/{name}", headers=TEXT) as r:
                assert r.status == 201
        final = {n: asyncio.get_running_loop().create_future() for n in names}
        readers = [asyncio.create_task(tail_sse(http, f"{b}/{n}", final[n])) for n in names]
        readers += [asyncio.create_task(tail_long_poll(http, f"{a}/{n}", final[n])) for n in names]
        history, stop = History(), asyncio.Event()
        writers = [asyncio.create_task(writer(http, g, n, f"{g[-12:-10]}w{i}", history, stop))
                   for n in names for i, g in enumerate((a, b))]  # fmt: skip
        await asyncio.sleep(0.5)
        retries_before = {r: retries(r) for r in ("moved", "ask", "tryagain")}
        moved = {}
        for name in names:  # each hot slot to the next primary, one after another, under load
            slot = slot_of(name)
            owner = cluster.slot_owner(slot)
            target = next(p for p in cluster.primaries if p is not owner)
            moved_keys = await asyncio.to_thread(cluster.migrate_slot, slot, target, 1)  # 1 key per MIGRATE
            assert moved_keys >= 2, f"slot {slot} moved only {moved_keys} keys"
            moved[name] = target
            await asyncio.sleep(0.3)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*writers)
        # The moves were felt: calls bounced off the old owners (and waited out the moves).
        assert retries("moved") > retries_before["moved"]
        assert retries("tryagain") + retries("ask") > retries_before["tryagain"] + retries_before["ask"]
        for name, target in moved.items():
            assert cluster.slot_owner(slot_of(name)) is target
            content = await read_all(http, f"{a}/{name}")
            history.check(name, content)
            assert len(history.acked[name]) > 10, f"{name}: too few appends to mean anything"
            final[name].set_result(len(content))
        seen = await caught_up(readers, names + names)
        for got, name in zip(seen, names + names, strict=True):
            assert got == await read_all(http, f"{a}/{name}"), (
                f"{name}: a live reader missed or repeated bytes"
            )


@pytest.mark.parametrize("ack", [0, 1])
async def test_manual_failover_under_load_loses_nothing(
    cluster: Cluster, http: aiohttp.ClientSession, ack: int
) -> None:
    """CLUSTER FAILOVER (coordinated: the replica catches up first) while writers append,
    with and without --min-replicas-ack: every acknowledged append survives."""
    (name,) = names_on_each_primary(cluster, prefix="fo")[:1]
    async with gateways(cluster, min_replicas_ack=ack, min_replicas_ack_timeout=2.0) as (gw,):
        async with http.put(f"{gw}/{name}", headers=TEXT) as r:
            assert r.status == 201
        history, stop = History(), asyncio.Event()
        writers = [asyncio.create_task(writer(http, gw, name, f"w{i}", history, stop)) for i in range(4)]
        await asyncio.sleep(0.5)
        primary = cluster.primary_of(keys.stream_keys(keys.stream_id(name))[0])
        await asyncio.to_thread(cluster.failover, cluster.replica_of(primary))
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*writers)
        history.check(name, await read_all(http, f"{gw}/{name}"))
        assert len(history.acked[name]) > 10


@pytest.mark.parametrize("ack", [0, 1])
async def test_primary_lost_with_an_unsynced_replica(
    cluster: Cluster, http: aiohttp.ClientSession, ack: int
) -> None:
    """What a failover after a crash loses. The replica stops taking the replication stream
    (paused, then cut off: the primary drops its link once more than 1 MB waits for it);
    the primary acknowledges what it alone has; then it dies and the replica takes over.

    Without --min-replicas-ack the appends acknowledged meanwhile are lost. With it they
    were never acknowledged (504: outcome unknown), and every acknowledged one survives."""
    name, filler = same_primary(cluster, 2)
    settings = {"min_replicas_ack": ack, "min_replicas_ack_timeout": 0.3, "redis_timeout": 2.0}
    async with gateways(cluster, **settings) as (gw,):
        for stream in (name, filler):
            async with http.put(f"{gw}/{stream}", headers=TEXT) as r:
                assert r.status == 201
        history = History()
        before = await append_records(http, gw, name, "before", history, 20)
        assert set(before) <= {200, 204}, before
        primary = cluster.primary_of(keys.stream_keys(keys.stream_id(name))[0])
        replica = cluster.replica_of(primary)
        with cluster.connect(primary) as c:
            c.config_set("client-output-buffer-limit", "replica 1048576 1048576 0")
        cluster.pause(replica)
        # More than the kernel's socket buffers hold, on the same primary: its link drops.
        chunk = b"x" * (1 << 20)
        for _ in range(24):
            async with http.post(f"{gw}/{filler}", data=chunk, headers=TEXT) as r:
                assert r.status in (200, 204, 504), r.status
        during = await append_records(http, gw, name, "during", history, 10)
        cluster.kill(primary)
        cluster.resume(replica)
        await asyncio.to_thread(
            cluster.wait_healthy,
            30,
            lambda: None if replica.role == "primary" else f"{replica} not promoted yet",
            "the replica taking over",
        )
        content = await read_all(http, f"{gw}/{name}")
        present = {r for r in content.decode().split(";") if r}
        assert {f"before.{i}" for i in range(20)} <= present
        if ack:
            assert set(during) == {504}, during  # never confirmed by a replica: not acknowledged
            history.check(name, content)  # every acknowledged append is there
        else:
            assert set(during) <= {200, 204}, during
            lost = [f"during.{i}" for i in range(10) if f"during.{i}" not in present]
            assert lost == [f"during.{i}" for i in range(10)], "acknowledged, unreplicated, then lost"


def same_primary(cluster: Cluster, count: int) -> list[str]:
    """``count`` stream names served by one primary."""
    first = f"crash-{uuid.uuid4().hex[:10]}"
    owner = cluster.primary_of(keys.stream_keys(keys.stream_id(first))[0])
    names = [first]
    while len(names) < count:
        name = f"crash-{uuid.uuid4().hex[:10]}"
        if cluster.primary_of(keys.stream_keys(keys.stream_id(name))[0]) is owner:
            names.append(name)
    return names


async def append_records(
    http: aiohttp.ClientSession, gw: str, name: str, who: str, history: History, count: int
) -> list[int]:
    """``count`` records ``<who>.<n>;`` one after another; their statuses."""
    statuses = []
    for n in range(count):
        record = f"{who}.{n}"
        async with http.post(f"{gw}/{name}", data=f"{record};", headers=TEXT) as r:
            statuses.append(r.status)
        if r.status in (200, 204):
            history.acked.setdefault(name, []).append(record)
        else:
            history.unknown.setdefault(name, set()).add(record)
    return statuses


async def test_no_node_reachable_is_not_sent() -> None:
    """A cluster nobody answers for: nothing was sent, so the caller may say 503 and retry."""
    from gateway.redis_io.connections import NotSent
    from gateway.redis_io.scripts import connect_scripts

    from .conftest import free_port

    scripts = connect_scripts(f"redis://127.0.0.1:{free_port()}", cluster=True, max_connections=2, timeout=1)
    try:
        with pytest.raises(NotSent):
            await scripts.on_stream("read", "nobody", -1, 0, "0", 0, 1)
    finally:
        await scripts.aclose()


async def test_a_script_asked_to_a_node_that_never_had_it(cluster: Cluster) -> None:
    """A slot being moved to a node without our scripts (a node added for resharding): the
    script is ASKed there and sent whole (EVAL) after ASKING, on that node."""
    from gateway.redis_io.scripts import connect_scripts

    bucket = keys.rate_bucket("ip:203.0.113.7", f"rule-{uuid.uuid4().hex}")
    slot = key_slot(bucket.encode())
    source = cluster.slot_owner(slot)
    target = next(p for p in cluster.primaries if p is not source)
    scripts = connect_scripts(cluster.seed_url, cluster=True, max_connections=4, timeout=5)
    try:
        await scripts.load()
        with cluster.connect(target) as t, cluster.connect(source) as s:
            t.execute_command("SCRIPT", "FLUSH")
            t.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.id)
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.id)
        try:
            before = retries("ask")
            # cost 0 writes nothing: no key is left on the importing node
            assert await scripts.run("rate_limit", [bucket], [1, 10, 0]) == [0]
            assert retries("ask") > before
        finally:
            with cluster.connect(target) as t, cluster.connect(source) as s:
                s.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
                t.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    finally:
        await scripts.aclose()


async def test_the_layout_check_scans_every_primary(cluster: Cluster) -> None:
    from gateway.redis_io import layout
    from gateway.redis_io.connections import general

    client = general(cluster.seed_url, cluster=True)
    try:
        with cluster.client() as c:
            c.set(f"someone-else:{uuid.uuid4().hex}", "x")  # a key that is not ours, on some node
        assert await layout._has_our_keys(client) in (True, False)  # answers, on every node
        with cluster.client() as c:
            c.hset(keys.stream_keys(keys.stream_id(f"layout-{uuid.uuid4().hex}"))[0], "ct", "x")
        assert await layout._has_our_keys(client)
    finally:
        await client.aclose()
