"""The fleet registry and rolling layout changes (gateway/redis_io/fleet.py, migration.py):
processes join under leases and say which layouts they read; ``migrate`` prepares a change
without stopping the build before, ``migrate --finish`` switches only once every live process
reads the new layout, waits until each writes it, then contracts; an interrupted finish
resumes. The changes here are described by the tests (this build has none pending); the
processes are real ones (a gateway, an archive worker) where the registry is what is shown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway.cli import doctor
from gateway.cli.embedded import EmbeddedRedis
from gateway.redis_io import fleet, keys, layout, migration
from gateway.redis_io.fleet import Membership
from gateway.redis_io.migration import Build, Rolling

from .cluster import Cluster
from .conftest import gateway_process, ready_worker

LEASE = 0.6  # short leases: members renew every 0.2 s here


@pytest.fixture
async def client(own_redis: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(own_redis.url)
    await c.set(keys.LAYOUT, 3)
    yield c
    await c.aclose()


@contextlib.asynccontextmanager
async def running(member: Membership) -> AsyncIterator[list[str]]:
    """``member`` joined and renewing for the block; what it was refused, if anything."""
    refusals: list[str] = []
    await member.join()
    task = asyncio.create_task(member.keep(refusals.append))
    try:
        yield refusals
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await member.leave()


def _fleet(url: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "fleet", "--redis-url", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


async def test_gateways_and_workers_join_and_leave(own_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """Real processes: each in the registry with its pid, the layouts it reads and the one
    it writes, out of it once stopped."""
    with gateway_process(own_redis.url, tmp_path / "gw.log"):
        worker = ready_worker(
            [sys.executable, "-m", "gateway", "archive", "--redis-url", own_redis.url,
             "--archive-url", str(tmp_path / "archive")]
        )  # fmt: skip
        try:
            listed = _fleet(own_redis.url)
            lines = listed.splitlines()
            assert lines[0].split() == ["ROLE", "HOST:PID", "BUILD", "READS", "WRITES", "LEASE"], listed
            reads = f"v{layout.OLDEST_READ}-v{layout.CURRENT}"
            gateways = [line.split() for line in lines if line.startswith("gateway ")]
            archivers = [line.split() for line in lines if line.startswith("archive ")]
            assert len(gateways) == 1 and len(archivers) == 1, listed
            written = f"v{layout.CURRENT}"  # (a new Redis starts at this build's newest layout)
            assert archivers[0][1].endswith(f":{worker.pid}"), listed
            assert archivers[0][3:5] == [reads, written], listed
            assert gateways[0][3:5] == [reads, written], listed
            assert lines[-1] == f"key layout: {written}; this build reads {reads}", listed
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0
    client = aioredis.Redis.from_url(own_redis.url)
    try:
        assert await fleet.members(client) == []  # both left as they stopped, before their leases ended
    finally:
        await client.aclose()


async def test_a_member_joins_only_a_layout_its_build_reads(client: aioredis.Redis) -> None:
    with pytest.raises(layout.Mismatch, match="this build needs v5: run `durable-streams migrate`"):
        await Membership(client, "gateway", reads=(4, 5)).join()
    with pytest.raises(layout.Mismatch, match="this build understands up to v2: upgrade"):
        await Membership(client, "gateway", reads=(2, 2)).join()
    assert await fleet.members(client) == []  # a refused member is not registered
    both = Membership(client, "gateway", reads=(3, 4))
    assert await both.join() == 3 and both.writing == 3
    (member,) = await fleet.members(client)
    assert (member.id, member.reads, member.writes, member.pid) == (both.id, (3, 4), 3, os.getpid())


async def test_a_lease_ends_unless_renewed(client: aioredis.Redis) -> None:
    gone = Membership(client, "archive", lease_seconds=0.3)
    await gone.join()
    async with running(Membership(client, "gateway", lease_seconds=0.3)) as refusals:
        await asyncio.sleep(0.8)  # two lease lengths: the renewed one is still there
        assert [m.role for m in await fleet.members(client)] == ["gateway"]
    assert refusals == []
    assert await client.hlen(keys.FLEET) == 0  # the dead one's record dropped by the other's renewals


async def test_a_stop_ends_the_renewals_though_redis_py_lost_the_cancellation(
    client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped while a renewal waits on Redis (one just back from a pause), redis-py
    answering with the cancellation lost: leaving still ends the renewals, promptly (they
    renewed for ever, and an archive worker given SIGTERM never exited)."""
    member = Membership(client, "archive", lease_seconds=0.3)
    await member.join()
    renewing = asyncio.Event()
    join = member.join

    async def swallowing() -> None:
        renewing.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await join()  # (as redis-py does: the reply read, the cancellation lost)

    monkeypatch.setattr(member, "join", swallowing)
    stop = asyncio.Event()
    leaving = None
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(member.kept(stop))
        await asyncio.wait_for(renewing.wait(), 5)
        leaving = asyncio.create_task(stack.aclose())
        done, _ = await asyncio.wait({leaving}, timeout=5)
        assert done, "leaving did not end: the renewals go on"
    await leaving
    assert await client.hlen(keys.FLEET) == 0


def _change(log: list[str], new: Membership | None = None) -> Build:
    """Layout v3 -> v4, rolling: what it did, in order, in ``log``."""

    async def fill_new_keys(redis: aioredis.Redis) -> None:
        """Fill the new keys (an example expand step)."""
        log.append("expand")

    async def rewrite_old_entries(redis: aioredis.Redis) -> None:
        """Rewrite what is still in v3 (an example contract step)."""
        assert int(await redis.get(keys.LAYOUT)) == 4 and await redis.get(keys.LAYOUT_OLDEST) == b"3"
        log.append(f"contract (the new build writes v{new.writing if new else '?'})")

    change = Rolling("v4", rewrite_old_entries, fill_new_keys)
    return Build(current=4, oldest_read=3, steps={}, rolling={3: change})


async def test_expand_then_finish_once_every_process_reads_the_new_layout(client: aioredis.Redis) -> None:
    log: list[str] = []
    said: list[str] = []
    old = Membership(client, "gateway", lease_seconds=LEASE, reads=(3, 3))
    new = Membership(client, "gateway", lease_seconds=LEASE, reads=(3, 4))
    worker = Membership(client, "archive", lease_seconds=LEASE, reads=(3, 4))
    build = _change(log, new)
    async with running(new) as new_refusals, running(worker):
        async with running(old) as old_refusals:
            # migrate: the expand step, nothing switched: the build before keeps running (or comes back)
            assert await migration.migrate(client, said.append, build=build) == 3
            assert log == ["expand"]
            assert said[-1].startswith("layout v3 is written; this build is ready to write v4"), said
            # --finish while a process of the build before runs: refused, nothing switched
            behind = r"1 live process\(es\) do not read key layout v4: gateway "
            with pytest.raises(layout.Mismatch, match=behind):
                await migration.migrate(client, said.append, finish=True, build=build, lease_seconds=LEASE)
            assert await client.get(keys.LAYOUT) == b"3" and log == ["expand", "expand"]
            assert not await client.exists(keys.LAYOUT_LOCK)
        assert old_refusals == []
        said.clear()
        assert (
            await migration.migrate(client, said.append, finish=True, build=build, lease_seconds=LEASE) == 4
        )
        assert log[-1] == "contract (the new build writes v4)"  # only once it writes the new layout
        assert said == [
            "layout v3 -> v4, expand: Fill the new keys (an example expand step).",
            "layout v3 -> v4: switched: v4 is written from now on",
            "waiting for 2 process(es) to write layout v4 (at their next renewal) and a lease (1 s)",
            "layout v3 -> v4, contract: Rewrite what is still in v3 (an example contract step).",
            "layout v4 is current",
        ]
        assert await client.get(keys.LAYOUT) == b"4" and not await client.exists(keys.LAYOUT_OLDEST)
        assert {m.writes for m in await fleet.members(client)} == {4}
        # the build before can no longer come back, nor can a build that reads only v3
        with pytest.raises(layout.Mismatch, match="understands up to v3"):
            await Membership(client, "gateway", reads=(3, 3)).join()
        with pytest.raises(layout.Mismatch, match="understands up to v3"):
            await layout.check(client, current=3)
        assert await layout.check(client, current=4, oldest_read=3) == 4
    assert new_refusals == []


async def test_a_process_of_the_build_before_waking_after_the_switch_stops(client: aioredis.Redis) -> None:
    """Paused past its lease (so the switch did not see it), it is refused at its next
    renewal: it must not write the old layout."""
    sleeper = Membership(client, "gateway", lease_seconds=0.3, reads=(3, 3))
    await sleeper.join()
    await asyncio.sleep(0.4)
    await migration.migrate(client, print, finish=True, build=_change([]), lease_seconds=LEASE)
    with pytest.raises(layout.Mismatch, match="holds key layout v4; this build understands up to v3"):
        await sleeper.join()
    assert [m.id for m in await fleet.members(client)] == []  # the switch dropped its ended lease


async def test_an_interrupted_finish_resumes(client: aioredis.Redis) -> None:
    log: list[str] = []
    calls = 0

    async def flaky(redis: aioredis.Redis) -> None:
        """Rewrite what is still in v3, failing the first time."""
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("the operator's laptop went to sleep")
        log.append("contract")

    build = Build(current=4, oldest_read=3, steps={}, rolling={3: Rolling("v4", flaky)})
    with pytest.raises(ConnectionError):
        await migration.migrate(client, print, finish=True, build=build, lease_seconds=LEASE)
    assert await client.get(keys.LAYOUT) == b"4" and await client.get(keys.LAYOUT_OLDEST) == b"3"
    assert not await client.exists(keys.LAYOUT_LOCK)  # released
    # Meanwhile: a build that reads only v4 refuses (v3 data remains), both kinds join.
    remains = "still holds data of key layout v3, which this build no longer reads"
    with pytest.raises(layout.Mismatch, match=remains):
        await layout.check(client, current=4, oldest_read=4)
    assert await layout.check(client, current=4, oldest_read=3) == 4
    half_done = await doctor.fleet_finding(client)
    assert (half_done.level, half_done.text) == (
        "warn", "0 live process(es); a layout change is half done: run `durable-streams migrate --finish`"
    ), half_done  # fmt: skip
    said: list[str] = []
    assert await migration.migrate(client, said.append, build=build) == 4  # without --finish: what is left
    assert said == ["layout v4 is written, data of v3 remains: run `durable-streams migrate --finish`"]
    assert await migration.migrate(client, print, finish=True, build=build, lease_seconds=LEASE) == 4
    assert log == ["contract"] and not await client.exists(keys.LAYOUT_OLDEST)
    assert await layout.check(client, current=4, oldest_read=4) == 4


async def test_finish_waits_for_every_member_to_write_the_new_layout(client: aioredis.Redis) -> None:
    """A member that reads the new layout but does not renew (stalled) holds the contract
    back: a clear refusal after the wait, and a later --finish completes."""
    stalled = Membership(client, "deliver", lease_seconds=30, reads=(3, 4))
    await stalled.join()
    assert stalled.writing == 3
    log: list[str] = []
    build = _change(log)
    stalls = r"1 live process\(es\) still write layout v3 after 1 s: deliver "
    with pytest.raises(layout.Mismatch, match=stalls):
        await migration.migrate(
            client, print, finish=True, build=build, wait_seconds=1.0, lease_seconds=LEASE
        )
    assert "contract" not in " ".join(log)
    await stalled.join()  # it renews: learns v4
    assert stalled.writing == 4
    await stalled.join()  # and says so
    assert await migration.migrate(client, print, finish=True, build=build, lease_seconds=LEASE) == 4
    assert log[-1].startswith("contract")


async def test_the_registry_on_a_cluster(redis_cluster: Cluster) -> None:
    """One slot for the layout, its lock and the registry: joins and the switch's look work
    through a cluster client (the switch itself is refused here: a member reads only v3)."""
    client = RedisCluster.from_url(redis_cluster.seed_url)
    held = await client.get(keys.LAYOUT)  # (the shared cluster's, given back after)
    try:
        await client.set(keys.LAYOUT, 3)
        member = Membership(client, "gateway", reads=(3, 3))
        assert await member.join() == 3
        try:
            assert member.id in [m.id for m in await fleet.members(client)]
            with pytest.raises(layout.Mismatch, match="do not read key layout v4"):
                async with layout.locked(client, 10) as token:
                    await fleet.switch(client, 3, 4, token)
            assert await client.get(keys.LAYOUT) == b"3"
        finally:
            await member.leave()
        assert member.id not in [m.id for m in await fleet.members(client)]
    finally:
        await (client.set(keys.LAYOUT, held) if held is not None else client.delete(keys.LAYOUT))
        await client.aclose()


async def test_a_member_whose_lease_may_have_ended_writes_nothing(client: aioredis.Redis) -> None:
    """Its own count: no renewal for a lease (less a margin) and ``writing`` is None, whatever
    Redis says, until a renewal answers."""
    member = Membership(client, "gateway", lease_seconds=0.8)
    assert member.writing is None  # not joined yet
    await member.join()
    assert member.writing == 3
    await asyncio.sleep(0.65)  # past the lease less its margin (a quarter of it): 0.6 s
    assert member.writing is None
    await member.join()
    assert member.writing == 3


async def test_nobody_joins_while_a_restore_writes(client: aioredis.Redis) -> None:
    await client.set(keys.RESTORING, "the seal of a backup")
    with pytest.raises(layout.Mismatch, match="`durable-streams restore` is writing into this Redis"):
        await Membership(client, "gateway").join()
    await client.delete(keys.RESTORING)
    assert await Membership(client, "gateway").join() == 3


async def test_joins_drop_the_records_of_processes_killed_outright(client: aioredis.Redis) -> None:
    for _ in range(3):
        await Membership(client, "gateway", lease_seconds=0.1).join()  # never leave
    await asyncio.sleep(0.2)
    assert await client.hlen(keys.FLEET) == 3 and await fleet.members(client) == []
    newcomer = Membership(client, "gateway")
    await newcomer.join()
    assert list(await client.hkeys(keys.FLEET)) == [newcomer.id.encode()]


async def test_finish_stops_when_a_failover_lost_the_switch(client: aioredis.Redis) -> None:
    """The switch written, then Redis holds the old layout again (a replica promoted without
    it): no contract, a clear refusal; and a switch whose migration lock is not its own."""
    stalled = Membership(client, "deliver", lease_seconds=30, reads=(3, 4))
    await stalled.join()  # reads v4, never renews: the wait goes on
    log: list[str] = []

    async def lose_the_switch() -> None:
        while await client.get(keys.LAYOUT) != b"4":
            await asyncio.sleep(0.01)
        await client.set(keys.LAYOUT, 3)

    losing = asyncio.create_task(lose_the_switch())
    with pytest.raises(layout.Mismatch, match=r"holds key layout b'3', not v4, after the switch"):
        await migration.migrate(client, print, finish=True, build=_change(log), lease_seconds=5)
    await losing
    assert "contract" not in " ".join(log)
    await client.set(keys.LAYOUT_LOCK, "someone else's")
    with pytest.raises(layout.Mismatch, match="the migration lock expired or changed hands"):
        await fleet.switch(client, 3, 4, "mine")
