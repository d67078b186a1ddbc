"""The Redis Cluster test fixture (tests/cluster.py) does what later cluster tests rely on:
it comes up whole, routes keys by hash tag, moves a slot under writes without losing an
acknowledged one, and fails over (on request, and when a primary dies)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from .cluster import Cluster


@pytest.fixture
def cluster(redis_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster, whole again after each test, even a failed one (the next starts
    from there)."""
    yield redis_cluster
    redis_cluster.heal()


def test_three_primaries_each_with_a_replica_cover_every_slot(cluster: Cluster) -> None:
    for node in cluster.nodes:
        with cluster.connect(node) as c:
            info = dict(line.split(":", 1) for line in c.execute_command("CLUSTER", "INFO").split())
        assert info["cluster_state"] == "ok", node
        assert info["cluster_slots_assigned"] == info["cluster_slots_ok"] == "16384", node
        assert info["cluster_size"] == "3" and info["cluster_known_nodes"] == "6", node
    assert len(cluster.primaries) == 3 and len(cluster.replicas) == 3
    assert {cluster.replica_of(p) for p in cluster.primaries} == set(cluster.replicas)
    for node in cluster.nodes:  # the roles the fixture reports are the nodes' own
        with cluster.connect(node) as c:
            assert c.execute_command("ROLE")[0] == {"primary": "master", "replica": "slave"}[node.role]
    # The seed URL, redis-py's way: one node's address, the client discovers the others.
    with RedisCluster.from_url(cluster.seed_url) as client:
        assert client.set("{seed}:k", "v") and client.get("{seed}:k") == b"v"
        assert len(client.get_primaries()) == 3


def test_keys_with_one_hash_tag_live_on_one_primary(cluster: Cluster) -> None:
    keys = ["{stream-1}:meta", "{stream-1}:data", "{stream-1}:readers"]
    owner = cluster.primary_of(keys[0])
    assert all(cluster.primary_of(k) is owner for k in keys) and owner.role == "primary"
    with cluster.client() as client:
        for k in keys:
            client.set(k, k)
    with cluster.connect(owner) as c:  # the owner answers itself, no redirect
        assert c.mget(keys) == keys
    other = next(p for p in cluster.primaries if p is not owner)
    with cluster.connect(other) as c, pytest.raises(redis.exceptions.MovedError):
        c.get(keys[0])
    # Tags spread over every primary.
    owners = {cluster.primary_of(f"{{stream-{i}}}") for i in range(50)}
    assert owners == set(cluster.primaries)


def test_migrate_slot_while_a_client_writes(cluster: Cluster) -> None:
    tag = f"{{resharded-{uuid.uuid4().hex[:8]}}}"  # fresh keys, should the test run again
    slot = key_slot(tag.encode())
    source = cluster.slot_owner(slot)
    target = next(p for p in cluster.primaries if p is not source)
    stream, hash_key = f"{tag}:stream", f"{tag}:hash"
    fillers = 400  # several MIGRATE batches, so the writer overlaps the move
    with cluster.client(decode_responses=True) as client:
        pipe = client.pipeline()
        for i in range(fillers):
            pipe.set(f"{tag}:filler:{i}", i)
        pipe.xadd(stream, {"i": "first"})
        pipe.hset(hash_key, "first", 0)
        pipe.execute()
        initial_id = client.xrange(stream)[0][0]

    # Writes to keys that exist on the source (the stream, the hash: served there until moved,
    # then ASK, then MOVED) and to new keys (ASK to the target while the slot is migrating).
    stream_ids: list[str] = []
    hash_fields: list[str] = []
    new_keys: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        with cluster.client(decode_responses=True) as w:
            i = 0
            while not stop.is_set():
                field, key = f"f{i}", f"{tag}:new:{i}"
                try:
                    stream_ids.append(w.xadd(stream, {"i": i}))
                    w.hset(hash_key, field, i)
                    hash_fields.append(field)
                    w.set(key, i)
                    new_keys.append(key)
                except redis.RedisError as e:  # outcome unknown: not counted as acknowledged
                    errors.append(e)
                i += 1

    def wait_for_writes(n: int) -> None:
        deadline = time.monotonic() + 10
        while len(new_keys) < n and not errors:
            assert time.monotonic() < deadline, "the writer stalled"
            time.sleep(0.01)

    def asking_calls() -> int:  # ASKING: what a client sends the target after an ASK redirect
        with cluster.connect(target) as c:
            return int(c.info("commandstats").get("cmdstat_asking", {}).get("calls", 0))

    asked_before = asking_calls()
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        wait_for_writes(20)
        moved = cluster.migrate_slot(slot, target, batch=20)
        wait_for_writes(len(new_keys) + 20)  # and some after, through MOVED
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert not errors, errors
    # Writes overlapped the move and were redirected (ASK) to the target: else this proves nothing.
    assert asking_calls() > asked_before
    assert moved >= fillers + 2  # plus new keys created on the source before it started

    assert cluster.primary_of(stream) is target
    with cluster.connect(target) as c:  # every acknowledged write, on the new owner itself
        assert [entry_id for entry_id, _ in c.xrange(stream)] == [initial_id, *stream_ids]
        assert set(c.hkeys(hash_key)) == {"first", *hash_fields}
        assert c.exists(*new_keys) == len(new_keys)
        assert c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == fillers + 2 + len(new_keys)
    with cluster.connect(source) as c:
        assert c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    with cluster.client(decode_responses=True) as client:  # a fresh client finds them too
        assert client.xlen(stream) == 1 + len(stream_ids)


def test_failover_promotes_the_replica_and_demotes_the_primary(cluster: Cluster) -> None:
    key = "{failover}:k"
    primary = cluster.primary_of(key)
    replica = cluster.replica_of(primary)
    with cluster.client() as client:
        client.set(key, "before")
        cluster.failover(replica)
        assert replica.role == "primary" and primary.role == "replica"
        assert cluster.replica_of(replica) is primary
        assert cluster.primary_of(key) is replica
        with cluster.connect(primary) as c:
            assert c.execute_command("ROLE")[0] == "slave"
        # An existing client follows the MOVED; the coordinated failover lost nothing.
        assert client.get(key) == b"before"
        assert client.set(key, "after") and client.get(key) == b"after"


def test_a_killed_primary_is_replaced_by_its_replica(cluster: Cluster) -> None:
    key = "{killed}:k"
    primary = cluster.primary_of(key)
    replica = cluster.replica_of(primary)
    with cluster.connect(primary) as c:
        c.set(key, "kept")
        assert c.wait(1, 5000) == 1  # on the replica before the kill (replication is async)
    started = time.monotonic()
    cluster.kill(primary)
    cluster.wait_healthy()  # no slot without a running primary: the replica took over
    took = time.monotonic() - started
    assert took > cluster.node_timeout_ms / 2000, took  # noticed by timeout, not told
    assert replica.role == "primary" and primary.role == "down"
    assert cluster.primary_of(key) is replica
    with cluster.client() as client:
        assert client.get(key) == b"kept"

    # Back on its port and files, it rejoins as the new primary's replica.
    cluster.restart(primary)
    cluster.wait_healthy()
    assert primary.role == "replica" and cluster.replica_of(replica) is primary


def test_a_paused_node_answers_again_when_resumed(cluster: Cluster) -> None:
    replica = cluster.replicas[0]
    cluster.pause(replica)
    try:
        with cluster.connect(replica, timeout=0.5) as c, pytest.raises(redis.TimeoutError):
            c.ping()  # the kernel accepts the connection; the process never answers
    finally:
        cluster.resume(replica)
    cluster.wait_healthy()
    assert replica.role == "replica"
