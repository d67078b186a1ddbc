"""Live-read wake-ups on a Redis Cluster: sharded pub/sub, one connection per shard
primary, channels following their slot through resharding and failovers.

The fan-out is driven directly, on a ``RedisCluster`` from the fixture's seed URL;
notices are published with SPUBLISH through a cluster client (routed by the
channel's slot, following MOVED). SPUBLISH answers how many clients of the node it
ran on heard it: 1 says the fan-out's subscription is on the slot's owner.

Every wait is bounded; waits for the cluster to recover are generous, so that only
a wake-up that never comes fails a test. The cluster is whole again after each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from redis.asyncio import Redis, RedisCluster
from redis.crc import key_slot

from gateway.live import shard_listener
from gateway.live.channels import Watch
from gateway.live.fanout import Fanout
from gateway.redis_io import keys

from .cluster import Cluster, Node
from .conftest import free_port

WAKE_SECONDS = 5.0  # how long a woken reader may take
RECOVER_SECONDS = 30.0  # a slot move or a failover, then the resubscription


@pytest.fixture
def cluster(redis_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster, whole again after each test (roles may have moved)."""
    yield redis_cluster
    redis_cluster.heal()


@contextlib.asynccontextmanager
async def cluster_fanout(cluster: Cluster, **options: float) -> AsyncIterator[tuple[Fanout, RedisCluster]]:
    """A fan-out on the cluster, and a cluster client to publish with."""
    fanout = Fanout(RedisCluster.from_url(cluster.seed_url), **options)
    publisher = RedisCluster.from_url(cluster.seed_url)
    await fanout.start()
    try:
        yield fanout, publisher
    finally:
        await fanout.close()
        await publisher.aclose()


def channel(sid: str) -> str:
    return keys.notify_channel(sid)


def slot(sid: str) -> int:
    return key_slot(channel(sid).encode())


def sid_on(cluster: Cluster, node: Node, name: str) -> str:
    """A fresh stream id whose channel's slot ``node`` serves."""
    tag = uuid.uuid4().hex[:8]
    for i in range(1000):
        sid = f"{name}-{tag}-{i}"
        if cluster.slot_owner(slot(sid)) is node:
            return sid
    raise AssertionError(f"no stream id found for {node}")


def subscribers(cluster: Cluster, node: Node, sid: str, sharded: bool = True) -> int:
    """How many clients of ``node`` have SSUBSCRIBEd (or SUBSCRIBEd) the stream's channel."""
    with cluster.connect(node) as c:
        reply = c.execute_command("PUBSUB", "SHARDNUMSUB" if sharded else "NUMSUB", channel(sid))
    return int(reply[1])


def pubsub_clients(cluster: Cluster, node: Node) -> list[dict[str, str]]:
    with cluster.connect(node) as c:
        return c.client_list(_type="pubsub")


def client_ids(cluster: Cluster, node: Node) -> set[str]:
    with cluster.connect(node) as c:
        return {client["id"] for client in c.client_list()}


async def eventually(check: Callable[[], object], what: str, seconds: float = RECOVER_SECONDS) -> None:
    """Until ``check()`` (run in a thread: it may block on a node) is truthy."""
    deadline = time.monotonic() + seconds
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = await asyncio.to_thread(check)
        except Exception as exc:  # a node restarting
            last = exc
        if last:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not after {seconds:.0f} s (last: {last!r})")


async def confirmed(watch: Watch) -> None:
    """The reader's registration was confirmed: it was woken, and its channel is subscribed."""
    assert await watch.wait(WAKE_SECONDS), "not woken by a confirmation"
    assert not watch.moved_since(time.monotonic()), "woken, but the channel is not confirmed"


async def append_reaches(publisher: RedisCluster | Redis, sid: str, watch: Watch, position: int) -> None:
    """Publish a one-byte append's notice with SPUBLISH: the subscription is on the slot's
    owner (one client there heard it), and the waiting reader learns of the append."""
    watch.reading()  # the reader read Redis (at its position): notices from now on apply
    notice = b"%d %d 0 1\nx" % (position, position + 1)
    assert await publisher.spublish(channel(sid), notice) == 1, "no subscriber on the slot's owner"
    assert await watch.wait(WAKE_SECONDS), "the reader was not woken by the notice"
    delivery = watch.delivery(position)  # a resubscription since would have cleared it
    assert delivery is not None and delivery.entries == ((position, b"x"),)


async def test_readers_on_every_primary_wake_on_one_connection_per_primary(cluster: Cluster) -> None:
    """Three streams on each primary: every reader wakes on its SPUBLISH, and each primary
    holds one pub/sub connection of ours, subscribed to its own three channels only."""
    sids = {node: [sid_on(cluster, node, f"every-{i}") for i in range(3)] for node in cluster.primaries}
    async with cluster_fanout(cluster) as (fanout, publisher), contextlib.AsyncExitStack() as stack:
        watches = {}
        for node_sids in sids.values():
            for sid in node_sids:
                watches[sid] = await stack.enter_async_context(fanout.watch(sid))
                await confirmed(watches[sid])
        for node, node_sids in sids.items():
            clients = await asyncio.to_thread(pubsub_clients, cluster, node)
            assert len(clients) == 1, f"{node}: {len(clients)} pub/sub connections"
            assert clients[0]["ssub"] == "3" and clients[0]["sub"] == "0", clients[0]
            for other in cluster.primaries:
                expected = 1 if other is node else 0
                assert [subscribers(cluster, other, sid) for sid in node_sids] == [expected] * 3
        for position, sid in enumerate(watches):
            await append_reaches(publisher, sid, watches[sid], position)


async def test_a_slot_moved_while_a_reader_waits(cluster: Cluster) -> None:
    """The slot of a watched channel moves to another primary: the old owner drops the
    subscription (sunsubscribe), the fan-out subscribes on the new owner, and that
    confirmation wakes the reader; notices published there reach it."""
    source = cluster.primaries[0]
    target = cluster.primaries[1]
    sid = sid_on(cluster, source, "moved")
    async with cluster_fanout(cluster) as (fanout, publisher), fanout.watch(sid) as watch:
        await confirmed(watch)
        await append_reaches(publisher, sid, watch, 0)
        woken = asyncio.create_task(watch.wait(RECOVER_SECONDS))
        try:
            await asyncio.to_thread(cluster.migrate_slot, slot(sid), target)
            assert await woken, "the reader was not woken after the slot moved"
        finally:
            woken.cancel()
        assert not watch.moved_since(time.monotonic()), "woken, but the channel is not confirmed"
        await eventually(lambda: subscribers(cluster, target, sid) == 1, "subscribed on the new owner")
        assert subscribers(cluster, source, sid) == 0
        await append_reaches(publisher, sid, watch, 1)
        # One connection per primary still: the source's holds no subscription now (so it is
        # no pub/sub client any more), the target's the channel.
        assert not await asyncio.to_thread(pubsub_clients, cluster, source)
        assert len(await asyncio.to_thread(pubsub_clients, cluster, target)) == 1
    await asyncio.to_thread(cluster.migrate_slot, slot(sid), source)  # as it was


async def test_a_reader_arriving_after_its_slot_moved_unbeknown(cluster: Cluster) -> None:
    """The fan-out's slot map is stale (a slot moved while none of its channels was
    watched): the SSUBSCRIBE goes to the old owner, which answers MOVED; the fan-out
    refreshes its map and subscribes on the new owner, whose confirmation counts."""
    source = cluster.primaries[0]
    target = cluster.primaries[1]
    first = sid_on(cluster, target, "first")
    sid = sid_on(cluster, source, "unbeknown")
    async with cluster_fanout(cluster) as (fanout, publisher):
        async with fanout.watch(first) as watch:  # the slot map is known from here on
            await confirmed(watch)
        await asyncio.to_thread(cluster.migrate_slot, slot(sid), target)
        try:
            async with fanout.watch(sid) as watch:
                await confirmed(watch)
                assert subscribers(cluster, target, sid) == 1
                await append_reaches(publisher, sid, watch, 0)
        finally:
            await asyncio.to_thread(cluster.migrate_slot, slot(sid), source)


async def test_a_failover_moves_the_subscriptions_to_the_new_primary(cluster: Cluster) -> None:
    """A coordinated failover demotes the channel's primary (it drops its shard
    subscriptions): the fan-out subscribes on the promoted replica, the reader is woken,
    later notices reach it, and no connection of ours is left on the demoted node."""
    old = cluster.primaries[0]
    replica = cluster.replica_of(old)
    sid = sid_on(cluster, old, "failover")
    async with cluster_fanout(cluster) as (fanout, publisher), fanout.watch(sid) as watch:
        await confirmed(watch)
        [ours] = await asyncio.to_thread(pubsub_clients, cluster, old)
        woken = asyncio.create_task(watch.wait(RECOVER_SECONDS))
        try:
            await asyncio.to_thread(cluster.failover, replica)
            assert await woken, "the reader was not woken after the failover"
        finally:
            woken.cancel()
        assert replica.role == "primary" and old.role == "replica"
        await eventually(lambda: subscribers(cluster, replica, sid) == 1, "subscribed on the new primary")
        await append_reaches(publisher, sid, watch, 0)
        gone = "our connection to the demoted node closed"
        await eventually(lambda: ours["id"] not in client_ids(cluster, old), gone)
        assert len(await asyncio.to_thread(pubsub_clients, cluster, replica)) == 1


async def test_a_killed_primary_is_replaced_by_its_replica(cluster: Cluster) -> None:
    """A primary dies: its connection fails, the fan-out keeps refreshing its slot map until
    the replica has taken over, subscribes there, and the waiting reader is woken; notices
    published on the new primary reach it. Readers of the other primaries are untouched."""
    victim = cluster.primaries[0]
    replica = cluster.replica_of(victim)
    other = cluster.primaries[1]
    sid = sid_on(cluster, victim, "killed")
    bystander = sid_on(cluster, other, "bystander")
    async with (
        cluster_fanout(cluster, health_seconds=1.0) as (fanout, publisher),
        fanout.watch(sid) as watch,
        fanout.watch(bystander) as calm,
    ):
        await confirmed(watch)
        await confirmed(calm)
        woken = asyncio.create_task(watch.wait(RECOVER_SECONDS))
        try:
            await asyncio.to_thread(cluster.kill, victim)
            # Published on the bystander's own node: a cluster client whose first command
            # comes now may try the dead node (its seed, or its default node for SPUBLISH).
            async with Redis(host="127.0.0.1", port=other.port) as direct:
                await append_reaches(direct, bystander, calm, 0)  # while the victim is down
            await asyncio.to_thread(cluster.wait_healthy, RECOVER_SECONDS)  # the replica took over
            assert await woken, "the reader was not woken after the failover"
        finally:
            woken.cancel()
        assert replica.role == "primary"
        await eventually(lambda: subscribers(cluster, replica, sid) == 1, "subscribed on the new primary")
        await append_reaches(publisher, sid, watch, 0)
        await append_reaches(publisher, bystander, calm, 1)


async def test_a_silent_primary_does_not_hold_up_the_others(cluster: Cluster) -> None:
    """A primary stops answering (SIGSTOP): readers of the other primaries keep getting
    their notices meanwhile; once it answers again (or its replica took over), its reader
    is woken by a new subscription and later notices reach it."""
    silent = cluster.primaries[0]
    sids = [sid_on(cluster, node, "silent") for node in cluster.primaries]
    async with (
        cluster_fanout(cluster, health_seconds=0.3) as (fanout, publisher),
        contextlib.AsyncExitStack() as stack,
    ):
        watches = [await stack.enter_async_context(fanout.watch(sid)) for sid in sids]
        for watch in watches:
            await confirmed(watch)
        await publisher.initialize()  # its slot map now: the seed node may be the one silenced
        woken = asyncio.create_task(watches[0].wait(RECOVER_SECONDS))
        try:
            await asyncio.to_thread(cluster.pause, silent)
            try:
                await asyncio.sleep(1.0)  # its listener gives up (PING after 0.3 s, unanswered 0.3 s later)
                for position, (sid, watch) in enumerate(zip(sids[1:], watches[1:], strict=True)):
                    await append_reaches(publisher, sid, watch, position)
            finally:
                await asyncio.to_thread(cluster.resume, silent)
            await asyncio.to_thread(cluster.wait_healthy, RECOVER_SECONDS)
            assert await woken, "not woken by a new subscription"
        finally:
            woken.cancel()
        owner = await asyncio.to_thread(cluster.slot_owner, slot(sids[0]))
        await eventually(lambda: subscribers(cluster, owner, sids[0]) == 1, "subscribed on the slot's owner")
        await append_reaches(publisher, sids[0], watches[0], 10)


async def test_an_idle_channel_is_unsubscribed_after_the_linger(cluster: Cluster) -> None:
    """Once its last reader has left, a channel stays subscribed for the linger, then is
    SUNSUBSCRIBEd on the connection of the node holding it (here: after its slot moved
    there); a new reader subscribes it again, on the same connection."""
    source = cluster.primaries[0]
    target = cluster.primaries[1]
    sid = sid_on(cluster, source, "linger")
    async with cluster_fanout(cluster, linger_seconds=1.0) as (fanout, publisher):
        async with fanout.watch(sid) as watch:
            await confirmed(watch)
            woken = asyncio.create_task(watch.wait(RECOVER_SECONDS))
            try:
                await asyncio.to_thread(cluster.migrate_slot, slot(sid), target)
                assert await woken
            finally:
                woken.cancel()
            await eventually(lambda: subscribers(cluster, target, sid) == 1, "subscribed on the new owner")
        left = time.monotonic()
        await eventually(lambda: subscribers(cluster, target, sid) == 0, "unsubscribed after the linger")
        assert time.monotonic() - left >= 0.9, "unsubscribed before the linger was over"
        async with fanout.watch(sid) as watch:
            await confirmed(watch)
            await append_reaches(publisher, sid, watch, 0)
            assert len(await asyncio.to_thread(pubsub_clients, cluster, target)) == 1
    await asyncio.to_thread(cluster.migrate_slot, slot(sid), source)


async def test_an_unreachable_cluster_is_retried_and_closing_does_not_wait_for_it() -> None:
    """No node answers: the fan-out keeps trying to read the slot map (no error escapes),
    a reader's registration is kept for when it does, and closing is prompt."""
    fanout = Fanout(RedisCluster.from_url(f"redis://127.0.0.1:{free_port()}"), health_seconds=0.2)
    await fanout.start()
    registering = asyncio.create_task(fanout.watch("nowhere").__aenter__())
    try:
        await asyncio.sleep(0.5)  # a few attempts
        assert fanout._task is not None and not fanout._task.done()
        assert not registering.done()  # waits (up to 5 s) for a confirmation that cannot come
    finally:
        registering.cancel()
        await asyncio.wait_for(fanout.close(), WAKE_SECONDS)


async def test_nodes_without_sharded_pubsub_get_classic_subscriptions(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis 6.2 nodes (simulated: the version the listeners read is patched) have no
    sharded pub/sub, and the scripts PUBLISH: each channel is SUBSCRIBEd on the connection
    of its slot's primary, one per primary; PUBLISH wakes the readers; an idle channel is
    UNSUBSCRIBEd there."""
    monkeypatch.setattr(shard_listener, "_version", lambda info: (6, 2))
    sids = {node: sid_on(cluster, node, "classic") for node in cluster.primaries}
    async with cluster_fanout(cluster, linger_seconds=0.5) as (fanout, publisher):
        async with contextlib.AsyncExitStack() as stack:
            watches = {sid: await stack.enter_async_context(fanout.watch(sid)) for sid in sids.values()}
            for watch in watches.values():
                await confirmed(watch)
            for node, sid in sids.items():
                [client] = await asyncio.to_thread(pubsub_clients, cluster, node)
                assert client["sub"] == "1" and client["ssub"] == "0", client
                for other in cluster.primaries:
                    assert subscribers(cluster, other, sid, sharded=False) == (1 if other is node else 0)
            for position, (sid, watch) in enumerate(watches.items()):
                watch.reading()  # the reader read Redis (at its position): notices from now on apply
                notice = b"%d %d 0 1\nx" % (position, position + 1)
                await publisher.publish(channel(sid), notice)  # on some node: every node hears it
                assert await watch.wait(WAKE_SECONDS)
                delivery = watch.delivery(position)
                assert delivery is not None and delivery.entries == ((position, b"x"),)

        def unsubscribed() -> bool:
            return all(subscribers(cluster, node, sid, sharded=False) == 0 for node, sid in sids.items())

        await eventually(unsubscribed, "unsubscribed after the linger")


async def test_a_failure_inside_routing_does_not_end_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while routing channels (here: a rerouting that raises once) is logged and the
    routing goes on: readers registered afterwards are subscribed and woken as ever."""
    from gateway.live import shards

    failures = []
    original = shards.Shards._reroute

    def failing_once(self: shards.Shards) -> None:
        if not failures:
            failures.append(1)
            raise KeyError("a bug")
        original(self)

    monkeypatch.setattr(shards.Shards, "_reroute", failing_once)
    node = cluster.primaries[0]
    async with cluster_fanout(cluster) as (fanout, publisher):
        first = sid_on(cluster, node, "before")
        async with fanout.watch(first) as watch:  # the first reroute raised; the next routes it
            await confirmed(watch)
            assert failures, "the failing reroute did not run"
            await append_reaches(publisher, first, watch, 0)
        later = sid_on(cluster, node, "after")
        async with fanout.watch(later) as watch:
            await confirmed(watch)
            await append_reaches(publisher, later, watch, 0)
        assert fanout._task is not None and not fanout._task.done(), "the routing task ended"


@pytest.mark.parametrize("answers", [False, True], ids=["then-fails", "then-answers"])
async def test_closing_while_redis_py_swallows_the_cancellation(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, answers: bool
) -> None:
    """The fan-out is closed while it refreshes the slot map, and redis-py loses the
    cancellation (its clean-up raised an error of its own instead, or it went on to
    another node and answered): closing still ends it, promptly. It once looped for ever
    (Python 3.11's timeouts then took every expiry for the lost cancellation's), and the
    test run with it (gateway/concurrency/cancelling.py)."""
    refreshing = asyncio.Event()

    async def swallowing(self: object, *args: object, **kwargs: object) -> None:
        refreshing.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if not answers:
                raise ConnectionError("disconnecting failed") from None

    fanout = Fanout(RedisCluster.from_url(cluster.seed_url))
    await fanout.start()
    async with fanout.watch(sid_on(cluster, cluster.primaries[0], "swallow")) as watch:
        await confirmed(watch)  # routed: the refreshes from here on are patched
    monkeypatch.setattr(type(fanout._redis.nodes_manager), "initialize", swallowing)
    fanout._subscriber._stale.set()  # as a MOVED or a lost node would
    await asyncio.wait_for(refreshing.wait(), WAKE_SECONDS)
    closing = asyncio.create_task(fanout.close())
    done, _ = await asyncio.wait({closing}, timeout=WAKE_SECONDS)
    assert done, "the fan-out did not close (its task is left running: it cannot be stopped)"
    await closing
    assert fanout._task is not None and fanout._task.cancelled()
