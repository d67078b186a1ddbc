"""Upgrades from earlier builds of this repository, built from its own history (tests/old_builds.py)
and run beside the working tree on the same Redis.

* A rolling update from the last release (``LAST_RELEASE``): three of its gateways behind nginx
  and an archive worker of its own, under load (writers, idempotent producers, SSE and long-poll
  readers, all through nginx), are replaced one by one by the working tree's (as
  tests/test_rolling_update.py rolls them), then the worker, then the working tree's ``migrate``
  and ``migrate --finish`` run. No client sees anything.
* Data written by the last build on key layout v2 (``LAYOUT_V2``): the working tree refuses it
  until ``migrate``, then serves every stream as it was (byte for byte, from every offset the old
  build gave out), continues its producers and appends after it.

Each test runs a Redis of its own: an old build stamps its own key layout on it, as a deployment
of that build did (the session's Redis is stamped with the working tree's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import redis.asyncio as aioredis
from redis import Redis as SyncRedis

from gateway.cli.embedded import EmbeddedRedis
from gateway.protocol import offsets
from gateway.redis_io import keys, layout

from .conftest import free_port, read_all
from .faults.harness import GATEWAY_CMD, GatewayProc, ServiceProc
from .old_builds import LAST_RELEASE, LAYOUT_V2, OldBuild, session_build
from .test_rolling_update import DELAY, RECORD_BYTES, Stream, follow, gateways_behind_nginx, roll, write

REPO_ROOT = Path(__file__).resolve().parents[1]

# Streams as (writers, SSE readers, long-poll readers, seconds between one writer's appends):
# two busy ones and a quiet one, lighter than test_rolling_update's (a long-poll reader asks
# again after every append it gets; an archive worker archives everything it can meanwhile; all
# on two cores).
STREAMS = [(2, 8, 2, 0.01), (2, 8, 2, 0.01), (1, 16, 2, 0.2)]
PRODUCERS = (2, 6, 2, 0.01)  # idempotent producers on a stream of their own, its readers, pause
PRODUCED = "P{producer:01d}:{seq:07d};"  # as wide as test_rolling_update's RECORD
assert len(PRODUCED.format(producer=0, seq=0)) == RECORD_BYTES


def logs_of(procs: list[ServiceProc], limit: int = 2000) -> str:
    return "\n".join(f"--- {p.name} ({' '.join(p.command[:1])}) ---\n{p.log_tail()[-limit:]}" for p in procs)


# ----------------------------------------------------------------------------------------------
# Processes


def archiver(name: str, redis_url: str, archive_dir: Path, logs: Path, build: OldBuild | None) -> ServiceProc:
    """An archive worker archiving as soon as it can (hot window 0, a round every 0.2 s): the data
    moves to Parquet under the readers, and small files are merged into the next round's
    (``--archive-min-bytes 2048``), so the new build's worker rewrites files the old one wrote
    while readers read them. ``build``: an earlier build's, else the working tree's."""
    port = free_port()
    args = ["archive", "--redis-url", redis_url, "--archive-url", str(archive_dir),
            "--archive-hot-bytes", "0", "--archive-hot-seconds", "0", "--archive-min-bytes", "2048",
            "--archive-max-delay", "0", "--archive-interval", "0.2", "--archive-file-bytes", "65536",
            "--archive-lease-seconds", "5", "--metrics-port", str(port),
            "--log-level", "warning"]  # fmt: skip
    if build is None:
        return ServiceProc(name, args, logs)
    return ServiceProc(name, args, logs, build.env, build.command(), build.cwd)


def start_healthy(worker: ServiceProc, seconds: float = 60) -> None:
    """Start a worker and wait for its /healthz (its loop runs)."""
    port = worker.args[worker.args.index("--metrics-port") + 1]
    worker.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not worker.running:
            code = worker.process.returncode if worker.process else None
            raise AssertionError(f"{worker.name} exited {code}:\n{worker.log_tail()}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        time.sleep(0.1)
    raise AssertionError(f"{worker.name} not healthy in {seconds:g} s:\n{worker.log_tail()}")


async def working_tree(*args: str, timeout: float = 60) -> tuple[int, str]:
    """``durable-streams ARGS`` of the working tree (this venv's): exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY_CMD, *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        return -9, f"(killed after {timeout:g} s)\n" + out.decode(errors="replace")
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def parquet_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.parquet") if not p.name.startswith(".")}


# ----------------------------------------------------------------------------------------------
# Clients


async def long_poll(http: aiohttp.ClientSession, url: str, got: bytearray, failures: list[str]) -> int:
    """Read the stream with long-polls to its end (Stream-Closed), each from the last answer's
    Stream-Next-Offset and echoing its Stream-Cursor. Returns the number of answers."""
    offset, cursor, answers = "-1", "", 0
    while True:
        params = {"offset": offset, "live": "long-poll", **({"cursor": cursor} if cursor else {})}
        try:
            async with http.get(url, params=params) as r:
                body = await r.read()
                if r.status not in (200, 204):
                    failures.append(f"long-poll at {offset}: {r.status} {body[:100]!r}")
                    await asyncio.sleep(0.05)
                    continue
                answers += 1
                if r.status == 200:
                    got.extend(body)
                offset = r.headers["Stream-Next-Offset"]
                cursor = r.headers.get("Stream-Cursor", cursor)
                if r.headers.get("Stream-Closed") == "true":
                    return answers
        except aiohttp.ClientError as exc:
            failures.append(f"long-poll at {offset}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.05)


async def produce(
    http: aiohttp.ClientSession, stream: Stream, producer: int, stop: asyncio.Event, failures: list[str]
) -> None:
    """An idempotent producer (epoch 0, Producer-Seq from 0): a new append is 200; after a
    failure it sends the same seq again (a 204 then: it was stored)."""
    seq, retry = 0, False
    while not stop.is_set():
        record = PRODUCED.format(producer=producer, seq=seq)
        stream.tried.add(record)
        headers = {"Content-Type": "text/plain", "Producer-Id": f"upgrade-{producer}",
                   "Producer-Epoch": "0", "Producer-Seq": str(seq)}  # fmt: skip
        try:
            async with http.post(stream.url, data=record, headers=headers) as r:
                body = await r.read()
                if r.status == 200 or (r.status == 204 and retry):
                    stream.acked.append(record)
                    seq, retry = seq + 1, False
                else:
                    failures.append(f"produce {record}: {r.status} {body[:100]!r}")
                    retry = True
        except aiohttp.ClientError as exc:
            failures.append(f"produce {record}: {type(exc).__name__}: {exc}")
            retry = True
        await asyncio.sleep(stream.pause)


def first_difference(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def records_of(data: bytes) -> list[str]:
    return [data[i : i + RECORD_BYTES].decode() for i in range(0, len(data), RECORD_BYTES)]


# ----------------------------------------------------------------------------------------------
# a. A rolling update from the last release


async def test_a_rolling_update_from_the_last_release_shows_clients_nothing(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, own_redis: EmbeddedRedis
) -> None:
    old = session_build(tmp_path_factory, LAST_RELEASE)
    redis_url = own_redis.url
    archive_dir = tmp_path / "archive"
    archive_dir.mkdir()
    flags = ["--archive-url", str(archive_dir)]
    write_failures: list[str] = []
    read_failures: list[str] = []
    workers: list[ServiceProc] = []
    client = aioredis.Redis.from_url(redis_url)
    with gateways_behind_nginx(
        tmp_path, redis_url, flags=flags, command=old.command(), cwd=old.cwd, env=old.env
    ) as (nginx, gateways):
        logs = tmp_path / "logs"

        def everyone() -> str:
            return logs_of([*gateways, *workers])

        workers.append(archiver("archive-old", redis_url, archive_dir, logs, old))
        try:
            await asyncio.to_thread(start_healthy, workers[0])
            # The last release's processes: no fleet registry (the working tree's would be there).
            assert await client.hlen(keys.FLEET) == 0, await client.hgetall(keys.FLEET)
            assert await client.get(keys.LAYOUT) == b"3", "the last release stamps key layout v3"
            connector = aiohttp.TCPConnector(force_close=True, limit=0)  # as test_rolling_update's
            timeout = aiohttp.ClientTimeout(total=120, sock_read=30)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
                run = uuid.uuid4().hex[:8]
                shapes = [*STREAMS, PRODUCERS]
                streams = [
                    Stream(f"{nginx.base}/v1/stream/upgrade-{run}-{i}", writers, pause,
                           [bytearray() for _ in range(sse + polls)])
                    for i, (writers, sse, polls, pause) in enumerate(shapes)
                ]  # fmt: skip
                produced = streams[-1]
                for stream in streams:
                    async with http.put(stream.url, headers={"Content-Type": "text/plain"}) as r:
                        assert r.status == 201, (r.status, await r.text())
                readers: list[asyncio.Task[int]] = []
                polled: list[asyncio.Task[int]] = []
                for stream, (_, sse, _, _) in zip(streams, shapes, strict=True):
                    readers += [asyncio.create_task(follow(http, stream.url, got, read_failures))
                                for got in stream.gots[:sse]]  # fmt: skip
                    polled += [asyncio.create_task(long_poll(http, stream.url, got, read_failures))
                               for got in stream.gots[sse:]]  # fmt: skip
                stop = asyncio.Event()
                clients = [asyncio.create_task(write(http, stream, w, stop, write_failures))
                           for stream in streams[:-1] for w in range(stream.writers)]  # fmt: skip
                clients += [asyncio.create_task(produce(http, produced, p, stop, write_failures))
                            for p in range(produced.writers)]  # fmt: skip
                try:
                    await asyncio.sleep(1.0)  # readers connected, keep-alive connections pooled
                    rollout = await roll(nginx, gateways, redis_url, flags=flags)
                    # Then the archive worker: the old one stops (SIGTERM), the new one starts.
                    archived_by_old = parquet_files(archive_dir)
                    old_exit = await asyncio.to_thread(workers[0].terminate, 30)
                    workers.append(archiver("archive-new", redis_url, archive_dir, logs, None))
                    await asyncio.to_thread(start_healthy, workers[1])
                    # Then the layout: the working tree's migrate, and its contract step.
                    migrated = await working_tree("migrate", "--redis-url", redis_url)
                    finished = await working_tree("migrate", "--finish", "--redis-url", redis_url)
                    listing = asyncio.create_task(working_tree("fleet", "--redis-url", redis_url))
                    # Until the new worker has archived something too (the load goes on).
                    deadline = time.monotonic() + 20
                    while not parquet_files(archive_dir) - archived_by_old and time.monotonic() < deadline:
                        await asyncio.sleep(0.2)
                    archived_by_new = parquet_files(archive_dir) - archived_by_old
                    fleet = await listing
                    members = await client.hlen(keys.FLEET)
                    await asyncio.sleep(0.5)  # steady traffic on the new build alone
                finally:
                    stop.set()
                    await asyncio.gather(*clients, return_exceptions=True)
                for stream in streams:
                    async with http.post(stream.url, headers={"Stream-Closed": "true"}) as r:
                        assert r.status == 204, (r.status, await r.text())
                try:
                    done = await asyncio.wait_for(asyncio.gather(*readers, *polled), 30)
                except TimeoutError:
                    raise AssertionError(
                        f"readers did not reach the streams' end in 30 s; failures: {read_failures[:5]}\n"
                        + everyone()
                    ) from None
                finally:
                    for task in [*readers, *polled]:
                        task.cancel()
                sse_responses, poll_answers = done[: len(readers)], done[len(readers) :]
                stored = [await read_all(http, stream.url) for stream in streams]
            layout_now = await client.get(keys.LAYOUT), await client.get(keys.LAYOUT_OLDEST)
        finally:
            for worker in workers:
                with contextlib.suppress(Exception):
                    worker.terminate(15)
            await client.aclose()
        logs_now = everyone()

    said = "\n".join(nginx.upstream_errors()[:5])
    assert not write_failures, (
        f"{len(write_failures)} appends failed: {write_failures[:5]}\n{said}\n{logs_now}"
    )
    assert not read_failures, f"{len(read_failures)} reads failed: {read_failures[:10]}\n{said}\n{logs_now}"
    assert migrated[0] == 0, f"migrate under load exited {migrated[0]}:\n{migrated[1]}\n{logs_now}"
    assert finished[0] == 0, f"migrate --finish under load exited {finished[0]}:\n{finished[1]}\n{logs_now}"
    assert f"layout v{layout.CURRENT} is current" in finished[1], finished[1]
    assert layout_now == (str(layout.CURRENT).encode(), None), layout_now
    for stream, data in zip(streams, stored, strict=True):
        records = records_of(data)
        assert len(records) == len(set(records)), f"{stream.url}: a record stored twice"
        assert set(records) <= stream.tried, f"{stream.url}: a record nobody sent"
        missing = set(stream.acked) - set(records)
        assert not missing, (
            f"{stream.url}: {len(missing)} acknowledged appends missing: {sorted(missing)[:5]}"
        )
        # Under load through the whole upgrade (the quiet stream's one writer: ~5 appends/s).
        assert len(stream.acked) >= 20 * stream.writers, (stream.url, len(stream.acked))
        for i, got in enumerate(stream.gots):
            assert bytes(got) == data, (
                f"{stream.url}: reader {i} got {len(got)} bytes, the stream holds {len(data)};"
                f" they differ from byte {first_difference(bytes(got), data)}"
            )
    # Each producer's appends once each, in its order, and nothing it was not told was stored.
    for producer in range(produced.writers):
        mine = [r for r in records_of(stored[-1]) if r.startswith(f"P{producer}:")]
        assert [int(r[3:10]) for r in mine] == list(range(len(mine))), f"producer {producer}: {mine[:10]}"
        assert len(mine) == sum(r.startswith(f"P{producer}:") for r in produced.acked)
    # The rollout as test_rolling_update sees it: the old gateways stopped gracefully, their SSE
    # responses ended (readers went on elsewhere), long-polls answered.
    assert rollout.exits == [0, 0, 0], f"{rollout.exits}\n{logs_now}"
    assert rollout.readiness == [503, 503, 503], rollout.readiness
    assert all(DELAY <= seconds < DELAY + 5 for seconds in rollout.seconds), rollout.seconds
    assert min(sse_responses) >= 2, sse_responses
    assert min(poll_answers) >= 2, poll_answers
    # Both workers archived under the load: the readers' catch-ups and the final reads span
    # the Parquet files of both builds and Redis.
    assert old_exit == 0, f"the old archive worker exited {old_exit} on SIGTERM\n{workers[0].log_tail()}"
    assert archived_by_old, f"the old archive worker archived nothing\n{workers[0].log_tail()}"
    assert archived_by_new, f"the new archive worker archived nothing in 20 s\n{workers[1].log_tail()}"
    # The fleet registry lists the working tree's processes, those alone (the last release's
    # never joined it).
    assert fleet[0] == 0, fleet[1]
    assert members == 4, fleet[1]
    for gw in gateways[3:]:
        assert gw.process is not None
        assert re.search(rf"^gateway\s+\S+:{gw.process.pid}\s", fleet[1], re.M), (gw.name, fleet[1])
    assert workers[1].process is not None
    assert re.search(rf"^archive\s+\S+:{workers[1].process.pid}\s", fleet[1], re.M), fleet[1]


# ----------------------------------------------------------------------------------------------
# b. Data written by layout v2, served after migrate


@dataclass
class Written:
    """A stream as the old build wrote it: what each write added and the offset it gave back."""

    url: str
    content_type: str
    pieces: list[tuple[str, bytes | list]] = field(default_factory=list)  # (next offset after, data)
    start: str = "-1"  # its offset before any piece (the creation's Stream-Next-Offset)
    created_with: dict[str, str] = field(default_factory=dict)  # the PUT's headers

    @property
    def json(self) -> bool:
        return self.content_type == "application/json"

    def after(self, offset: str) -> bytes | list:
        """What the stream holds from ``offset`` (one the old build gave out, or -1) on."""
        at = 0 if offset in ("-1", self.start) else [o for o, _ in self.pieces].index(offset) + 1
        return joined(self.json, [data for _, data in self.pieces[at:]])

    def offsets(self) -> list[str]:
        return list(dict.fromkeys(["-1", self.start, *(o for o, _ in self.pieces)]))


def joined(is_json: bool, pieces: list) -> bytes | list:
    return [m for piece in pieces for m in piece] if is_json else b"".join(pieces)


@dataclass
class Read:
    data: bytes | list
    body: bytes  # the answers' bodies, joined (byte for byte)
    next_offset: str
    closed: bool


async def read_from(http: aiohttp.ClientSession, url: str, offset: str) -> Read:
    """A stream from ``offset`` to its end (catch-up reads, following Stream-Next-Offset)."""
    bodies: list[bytes] = []
    for _ in range(1000):
        async with http.get(url, params={"offset": offset}) as r:
            chunk = await r.read()
            assert r.status == 200, (url, offset, r.status, chunk[:200])
            bodies.append(chunk)
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                is_json = r.headers["Content-Type"].startswith("application/json")
                data = joined(is_json, [json.loads(b) for b in bodies] if is_json else bodies)
                return Read(data, b"".join(bodies), offset, r.headers.get("Stream-Closed") == "true")
    raise AssertionError(f"{url}: the read never got up to date")


async def put(
    http: aiohttp.ClientSession, url: str, expect: int = 201, **headers: str
) -> aiohttp.ClientResponse:
    async with http.put(url, headers=headers) as r:
        text = await r.text()
        assert r.status == expect, (url, headers, r.status, text)
        return r


async def append(
    http: aiohttp.ClientSession,
    stream: Written,
    data: bytes,
    piece: bytes | list,
    expect: int = 204,
    **headers: str,
) -> str:
    """POST ``data``; the piece it adds is recorded with the offset returned."""
    async with http.post(
        stream.url, data=data, headers={"Content-Type": stream.content_type, **headers}
    ) as r:
        text = await r.text()
        assert r.status == expect, (stream.url, len(data), headers, r.status, text)
        offset = r.headers["Stream-Next-Offset"]
    stream.pieces.append((offset, piece))
    return offset


async def next_offset(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    async with http.head(url) as r:
        assert r.status == 200, (url, r.status)
        return r


async def write_v2_set(http: aiohttp.ClientSession, base: str) -> dict[str, Written]:
    """Streams of every kind the layout-v2 build wrote, through it; every offset it gave kept."""
    streams = {
        name: Written(f"{base}/v2-{name}", content_type)
        for name, content_type in [
            ("bytes", "application/octet-stream"), ("json", "application/json"),
            ("producer", "text/plain"), ("closed", "text/plain"), ("ttl", "text/plain"),
        ]
    }  # fmt: skip
    for name, stream in streams.items():
        stream.created_with = {
            "Content-Type": stream.content_type,
            **({"Stream-TTL": "3600"} if name == "ttl" else {}),
        }
        r = await put(http, stream.url, **stream.created_with)
        stream.start = r.headers["Stream-Next-Offset"]
    blob = os.urandom(1536 * 1024)  # over 1 MiB: one entry in layout v2 (4 MiB bodies)
    for data in [b"\x00first\xff", os.urandom(70_000), blob, os.urandom(3), bytes(range(256)) * 4]:
        await append(http, streams["bytes"], data, data)
    messages = [b'{"a":1}', b'[1,2,{"b":"c"}]', b'"x"', b'[[3],[4],{"d":[5]}]', b"null", b'{"e":"\xc3\xa9"}']
    for raw in messages:
        value = json.loads(raw)
        await append(http, streams["json"], raw, value if raw.startswith(b"[") else [value])
    producer = streams["producer"]
    for seq in range(5):
        record = f"p-{seq};".encode()
        await append(http, producer, record, record, 200, **producer_headers(seq))
    async with http.post(producer.url, data=b"p-4;", headers=producer_headers(4)) as r:
        assert r.status == 204, f"the old build took a replayed Producer-Seq as new: {r.status}"
    for data in [b"one;", b"two;"]:
        await append(http, streams["closed"], data, data)
    async with http.post(streams["closed"].url, headers={"Stream-Closed": "true"}) as r:
        assert r.status == 204, r.status
    for data in [b"short-lived;", b"still here;"]:
        await append(http, streams["ttl"], data, data)
    # Forks (layout v2 has them): of the bytes stream and of the JSON stream, each at an offset
    # it gave out mid-stream, then appended to.
    for name, source, at in [("fork-bytes", streams["bytes"], 1), ("fork-json", streams["json"], 2)]:
        fork = Written(f"{base}/v2-{name}", source.content_type)
        fork.created_with = {
            "Content-Type": source.content_type,
            "Stream-Forked-From": urlsplit(source.url).path,
            "Stream-Fork-Offset": source.pieces[at][0],
        }
        r = await put(http, fork.url, **fork.created_with)
        # Its data before its own appends, as one piece: the source's up to the fork offset.
        prefix = joined(fork.json, [p for _, p in source.pieces[: at + 1]])
        fork.pieces.append((r.headers["Stream-Next-Offset"], prefix))
        more = b'{"forked":true}' if fork.json else b"forked;"
        await append(http, fork, more, [json.loads(more)] if fork.json else more)
        streams[name] = fork
    return streams


def producer_headers(seq: int) -> dict[str, str]:
    return {
        "Content-Type": "text/plain",
        "Producer-Id": "v2-producer",
        "Producer-Epoch": "0",
        "Producer-Seq": str(seq),
    }


async def test_data_written_by_layout_v2_is_served_after_migrate(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, own_redis: EmbeddedRedis
) -> None:
    old = session_build(tmp_path_factory, LAYOUT_V2)
    logs = tmp_path / "logs"
    logs.mkdir()
    v2 = GatewayProc("v2", own_redis.url, logs, [], old.env, old.command(), old.cwd)
    new = GatewayProc("new", own_redis.url, logs)
    try:
        await asyncio.to_thread(v2.start_ready)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            streams = await write_v2_set(http, f"{v2.base}/v1/stream")
            # What the old build itself serves, from -1 and from every offset it gave out.
            before = {}
            for name, s in streams.items():
                for at in s.offsets():
                    before[name, at] = await read_from(http, s.url, at)
            heads = {name: (await next_offset(http, s.url)).headers.copy() for name, s in streams.items()}
            for (name, at), read in before.items():  # the old build read back what was sent
                assert read.data == streams[name].after(at), (name, at)
            assert v2.terminate(30) == 0, v2.log_tail()
            with SyncRedis.from_url(own_redis.url) as client:
                assert client.get(keys.LAYOUT) == b"2", "the old build stamped another layout"

            # The working tree refuses that layout until migrate.
            port = str(free_port())
            code, said = await working_tree(
                "serve", "--host", "127.0.0.1", "--port", port, "--redis-url", own_redis.url
            )
            assert code not in (0, -9) and "migrate" in said, (code, said[-2000:])
            code, migrated = await working_tree("migrate", "--redis-url", own_redis.url)
            assert code == 0, migrated
            # the offline steps to v3, then the rolling change to v4 waits for --finish
            assert "layout v2 -> v3" in migrated and "ready to write v4" in migrated, migrated

            await asyncio.to_thread(new.start_ready)
            for s in streams.values():
                s.url = s.url.replace(v2.base, new.base)
            problems: list[str] = []
            for (name, at), was in before.items():
                now = await read_from(http, streams[name].url, at)
                if (now.body, now.closed) != (was.body, was.closed):
                    problems.append(
                        f"{name} from {at}: {len(now.body)} bytes (closed: {now.closed}), the v2 build served"
                        f" {len(was.body)} (closed: {was.closed}); first bytes now {now.body[:60]!r}"
                        f" then {was.body[:60]!r}"
                    )
                elif offsets.decode(now.next_offset) != offsets.decode(was.next_offset):
                    problems.append(f"{name} from {at}: ends at {now.next_offset}, v2's at {was.next_offset}")
            for name, s in streams.items():
                now_, then = (await next_offset(http, s.url)).headers, heads[name]
                for header in ("Stream-Next-Offset", "Content-Type", "Stream-Closed", "Stream-TTL"):
                    a, b = now_.get(header), then.get(header)
                    if header == "Stream-Next-Offset" and a and b:  # the same position, minted anew
                        a, b = str(offsets.decode(a)), str(offsets.decode(b))
                    if a != b:
                        problems.append(
                            f"HEAD {name}: {header} {now_.get(header)!r}, v2's {then.get(header)!r}"
                        )
            assert not problems, "\n".join(problems) + "\n" + logs_of([v2, new])

            # The producer: a replayed old seq is a duplicate, the next one new, once.
            producer = streams["producer"]
            async with http.post(producer.url, data=b"p-4;", headers=producer_headers(4)) as r:
                said = await r.text()
                assert r.status == 204, f"a replayed Producer-Seq after the migration: {r.status} {said}"
            await append(http, producer, b"p-5;", b"p-5;", 200, **producer_headers(5))
            async with http.post(producer.url, data=b"p-5;", headers=producer_headers(5)) as r:
                assert r.status == 204, r.status
            async with http.post(producer.url, data=b"p-7;", headers=producer_headers(7)) as r:
                assert r.status == 409, f"a gap in Producer-Seq: {r.status}"
            # The closed stream stays closed; every other one PUT again as it was made (its TTL,
            # a fork's source and fork offset as the old build gave it) is the same stream: 200.
            closed = streams["closed"].url
            async with http.post(closed, data=b"three;", headers={"Content-Type": "text/plain"}) as r:
                assert (r.status, r.headers.get("Stream-Closed")) == (409, "true"), r.status
            for name, s in streams.items():
                if name != "closed":
                    await put(http, s.url, 200, **s.created_with)
            # New appends on every open stream; reads span the old data and the new.
            for name, s in streams.items():
                if name in ("closed", "producer"):
                    continue
                last = s.pieces[-1][0]
                raw = b'{"after":"migrate"}' if s.json else b"after-migrate;" + os.urandom(8)
                offset = await append(http, s, raw, [json.loads(raw)] if s.json else raw)
                assert offset > last, f"{name}: the new offset {offset} does not sort after {last}"
            for name, s in streams.items():
                for at in s.offsets():
                    got = await read_from(http, s.url, at)
                    want = s.after(at)
                    assert got.data == want, f"{name} from {at}: {str(got.data)[:200]} != {str(want)[:200]}"
            produced = await read_all(http, streams["producer"].url)
            assert produced == b"".join(f"p-{i};".encode() for i in range(6)), produced
    finally:
        v2.terminate(15)
        new.terminate(15)
