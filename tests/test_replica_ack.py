"""``--min-replicas-ack N``: a write is acknowledged only once N replicas have it.

One Redis primary of the test's own with one replica (``REPLICAOF``); the replica
is paused (SIGSTOP) to stop it confirming. The cluster side (a failover losing, or
not, what the primary alone had) is in tests/test_cluster.py. Plus the pure parts:
the setting's checks, WAIT or WAITAOF by server version, and node URLs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from gateway.cli.embedded import EmbeddedRedis
from gateway.config import Settings, conflict
from gateway.redis_io.routing import node_url
from gateway.redis_io.scripts import ReplicaAck, replica_ack, supports_waitaof

from .conftest import own_redis_server, read_all, redis_server_binary, serving

TEXT = {"Content-Type": "text/plain"}


async def created(http: aiohttp.ClientSession, url: str) -> str:
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 201
    return url


@pytest.fixture
def primary_and_replica(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    redis_server_binary("needs redis-server binaries for a primary and its replica")
    with own_redis_server(tmp_path / "primary") as primary, own_redis_server(tmp_path / "replica") as replica:
        with redis.Redis(port=replica.port) as c:
            c.replicaof("127.0.0.1", primary.port)
        deadline = time.monotonic() + 20
        with redis.Redis(port=primary.port) as c:
            while c.info("replication")["connected_slaves"] < 1 or c.wait(1, 100) < 1:
                assert time.monotonic() < deadline, "the replica never caught up"
                time.sleep(0.05)
        yield primary, replica


async def test_writes_wait_for_the_replica(
    primary_and_replica: tuple[EmbeddedRedis, EmbeddedRedis], http: aiohttp.ClientSession
) -> None:
    primary, replica = primary_and_replica
    async with serving(primary.url, min_replicas_ack=1, min_replicas_ack_timeout=0.3) as base:
        url = await created(http, f"{base}/acked")
        async with http.post(url, data=b"one;", headers=TEXT) as r:
            assert r.status in (200, 204)
        with redis.Redis(port=replica.port) as c:  # acknowledged: the replica has it already
            assert c.hget("ds:{acked}:meta", "tail") == b"4"
        assert replica.process is not None
        os.kill(replica.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            async with http.post(url, data=b"two;", headers=TEXT) as r:
                assert r.status == 504, await r.text()  # stored on the primary, not confirmed
                assert "outcome unknown" in await r.text()
            assert time.monotonic() - started < 5  # the wait is bounded by the timeout
            async with http.put(f"{base}/unconfirmed", headers=TEXT) as r:
                assert r.status == 503  # a create (idempotent: retry it) is not confirmed either
            async with http.get(url, params={"offset": "-1"}) as r:  # reads do not wait
                assert r.status == 200
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
        async with http.post(url, data=b"three;", headers=TEXT) as r:
            assert r.status in (200, 204)
        assert await read_all(http, url) == b"one;two;three;"  # the 504 was stored, as it said it may be


async def test_without_replicas_no_write_is_acknowledged(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    redis_server_binary()
    with own_redis_server(tmp_path / "alone") as alone:
        async with serving(alone.url, min_replicas_ack=1, min_replicas_ack_timeout=0.1) as base:
            async with http.put(f"{base}/lonely", headers=TEXT) as r:
                assert r.status == 503


def test_settings() -> None:
    assert replica_ack(0, 1.0) is None
    assert replica_ack(2, 0.25) == ReplicaAck(2, 250)
    assert conflict(Settings(min_replicas_ack=1)) is not None  # the embedded Redis has no replicas
    assert conflict(Settings(redis_cluster=True)) is not None  # a cluster needs its address
    assert conflict(Settings(redis_cluster=True, redis_url="unix:///tmp/r.sock")) is not None
    assert conflict(Settings(redis_cluster=True, redis_url="redis://h:7000", min_replicas_ack=1)) is None
    slow = Settings(redis_url="redis://h:7", min_replicas_ack=1, min_replicas_ack_timeout=5, redis_timeout=5)
    assert conflict(slow) is not None  # the socket would time out first


def test_wait_or_waitaof() -> None:
    assert not supports_waitaof("7.0.15") and not supports_waitaof("6.2.14")
    assert supports_waitaof("7.2.4") and supports_waitaof("8.0.0")
    assert ReplicaAck(1, 100).confirmed(1) == 1
    assert ReplicaAck(1, 100, aof=True).confirmed([1, 0]) == 0  # [local fsyncs, replica fsyncs]


def test_node_urls_keep_credentials_and_scheme() -> None:
    assert node_url("redis://127.0.0.1:7000", "10.0.0.2", 7001) == "redis://10.0.0.2:7001"
    assert node_url("rediss://u:p@seed:7000/0?ssl_cert_reqs=none", "n2", 7002) == (
        "rediss://u:p@n2:7002/0?ssl_cert_reqs=none"
    )
    assert node_url("redis://seed:7000", "::1", 7003) == "redis://[::1]:7003"


async def test_a_write_whose_wait_fails_is_outcome_unknown(
    primary_and_replica: tuple[EmbeddedRedis, EmbeddedRedis], tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The script ran, then its WAIT was cut short (the primary demoted while waiting: Redis
    answers UNBLOCKED): the append may be stored, so 504, never 503 (which says "not stored")."""
    primary, _ = primary_and_replica
    settings = {"min_replicas_ack": 2, "min_replicas_ack_timeout": 3, "redis_timeout": 5}
    async with serving(primary.url, **settings) as base:
        url = f"{base}/demoted"
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 503  # two replicas asked, one there: never confirmed
        with own_redis_server(tmp_path / "new-primary") as new_primary:
            append = asyncio.create_task(http.post(url, data=b"x", headers=TEXT))
            await asyncio.sleep(0.5)  # the script ran; its WAIT is waiting
            with redis.Redis(port=primary.port) as c:
                c.replicaof("127.0.0.1", new_primary.port)
            r = await asyncio.wait_for(append, 10)
            assert r.status == 504, await r.text()
            r.release()


async def test_a_script_the_server_forgot_is_sent_whole(
    primary_and_replica: tuple[EmbeddedRedis, EmbeddedRedis], http: aiohttp.ClientSession
) -> None:
    primary, _ = primary_and_replica
    async with serving(primary.url, min_replicas_ack=1, min_replicas_ack_timeout=1) as base:
        url = await created(http, f"{base}/forgotten")
        with redis.Redis(port=primary.port) as c:
            c.script_flush()
        async with http.post(url, data=b"again", headers=TEXT) as r:
            assert r.status in (200, 204)
        assert await read_all(http, url) == b"again"


async def test_a_transient_failure_of_the_checks_is_not_a_refusal() -> None:
    """--require-durable refuses a Redis that may lose writes, not one that did not answer
    (a node restarting): that is retried."""
    from gateway.redis_io import durability
    from gateway.redis_io.connections import general

    from .conftest import free_port

    client = general(f"redis://127.0.0.1:{free_port()}", cluster=False, socket_connect_timeout=1)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            await durability.check(client, require=True)
    finally:
        await client.aclose()


async def test_the_archive_keeps_files_until_the_replicas_confirm(
    primary_and_replica: tuple[EmbeddedRedis, EmbeddedRedis], tmp_path: Path
) -> None:
    """With --min-replicas-ack a worker deletes a file only once a write after what freed
    it is confirmed by the replicas: else a failover could bring back a record naming it."""
    import pyarrow as pa

    from gateway.archive.files import Archive
    from gateway.redis_io.connections import general
    from gateway.redis_io.scripts import NotReplicated, connect_scripts
    from workers.archiver import Archiver, Policy

    primary, replica = primary_and_replica
    archive = Archive(str(tmp_path / "archive"))
    archive.write("gone.parquet", pa.table({"data": [b"x"]}))
    client = general(primary.url, cluster=False)
    scripts = connect_scripts(
        primary.url, cluster=False, max_connections=4, timeout=5, replica_ack=replica_ack(1, 0.3)
    )
    archiver = Archiver(client, archive, Policy(), scripts=scripts)
    assert replica.process is not None
    try:
        await scripts.load()
        async with archiver.leases.held("dead-stream") as lease:  # no such stream: nothing names the file
            assert lease is not None
            os.kill(replica.process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(NotReplicated):
                    await archiver.files.delete_unnamed(lease, "inc-1", [_segment("gone.parquet")])
                assert "gone.parquet" in archive.files()  # kept: the replicas did not confirm
            finally:
                os.kill(replica.process.pid, signal.SIGCONT)
            await archiver.files.delete_unnamed(lease, "inc-1", [_segment("gone.parquet")])
            assert "gone.parquet" not in archive.files()
    finally:
        await scripts.aclose()
        await client.aclose()


def _segment(file: str):  # type: ignore[no-untyped-def]
    from gateway.archive.segments import Segment

    return Segment.parse(f"0 10 1 2 {file}")
