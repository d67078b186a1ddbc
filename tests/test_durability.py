"""Acknowledged means durable, and what these tests do and do not prove.

``test_acknowledged_appends_survive_kill_9`` proves survival of a *Redis
process crash*: SIGKILL under concurrent appends, restart on the same files,
every acknowledged append is there once, in order. It cannot catch a missing
fsync: after SIGKILL the kernel still holds the page cache, so Redis' write()s
reach the restarted process whether or not they were fsynced. It passes just
as well with ``appendfsync no``. Only a machine crash or power loss (which no
test here causes) tells the two apart.

``test_embedded_redis_fsyncs_every_write`` closes that gap by the settings:
the embedded Redis that ``durable-streams serve`` starts reports (CONFIG GET,
the values in effect) ``appendonly yes`` and ``appendfsync always``, the mode in
which Redis fsyncs the AOF before it replies to a write, so before the
gateway's 2xx. It fails if either setting is weakened. It also checks that an
acknowledged append is already in the AOF file (written before the reply) and
that Redis reports no failed AOF write; it does not observe the fsync system
call itself (no counter of fsyncs exists; a page-cache check cannot tell).

``test_require_durable_*``: against an external Redis, ``--require-durable``
starts only on ``appendonly yes`` + ``appendfsync always`` and refuses the rest,
with one line saying why.

Eviction: a Redis with any ``maxmemory-policy`` but ``noeviction`` deletes keys
when full, acknowledged streams included: the gateway warns loudly, refuses
under ``--require-durable``, and the embedded Redis runs with ``noeviction``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from gateway.cli.embedded import EmbeddedRedis
from gateway.redis_io.durability import assess, assess_eviction

from .conftest import free_port, read_all, redis_server_binary, start_gateway, wait_ready


async def test_acknowledged_appends_survive_kill_9(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession
) -> None:
    gateway = await start_gateway(own_redis.url)
    url = str(gateway.make_url("/v1/stream/durable"))
    acked: list[bytes] = []
    try:
        async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 201

        async def writer(n: int) -> None:
            for i in range(10_000):
                item = f"[{n}:{i}]".encode()
                try:
                    async with http.post(url, data=item, headers={"Content-Type": "text/plain"}) as r:
                        if r.status == 204:
                            acked.append(item)
                        else:
                            return
                except aiohttp.ClientError:
                    return

        writers = [asyncio.create_task(writer(n)) for n in range(8)]
        await asyncio.sleep(1.0)
        own_redis.kill()  # SIGKILL: no shutdown, no final flush
        await asyncio.wait_for(asyncio.gather(*writers), 30)
        assert len(acked) > 50

        own_redis.start()
        stored = b""
        for _ in range(50):  # the gateway reconnects by itself
            async with http.get(url) as r:
                if r.status == 200:
                    stored = await read_all(http, url)
                    break
            await asyncio.sleep(0.1)
    finally:
        await gateway.close()
    missing = [item for item in acked if item not in stored]
    assert missing == []
    for n in range(8):  # each writer's items are in its own order, once
        mine = [item for item in acked if item.startswith(f"[{n}:".encode())]
        positions = [stored.index(item) for item in mine]
        assert positions == sorted(positions)
        assert all(stored.count(item) == 1 for item in mine)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DURABLE_STREAMS_REDIS_URL")}


@contextlib.contextmanager
def _serving(*args: str, stderr: Any = subprocess.PIPE, clean_exit: bool = True) -> Iterator[int]:
    """``durable-streams serve <args>`` on a free port until the block ends (``clean_exit``: and
    then exits 0 on SIGTERM)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port), *args],
                            env=_env(), stderr=stderr, text=True)  # fmt: skip
    try:
        wait_ready(port, proc)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
        assert code == 0 or not clean_exit


def test_embedded_redis_fsyncs_every_write(tmp_path: Path) -> None:
    """The embedded Redis of `durable-streams serve` runs with fsync on every write."""
    redis_server_binary()
    data_dir = tmp_path / "data"
    with _serving("--data-dir", str(data_dir), stderr=subprocess.DEVNULL, clean_exit=False) as port:
        with redis.Redis(unix_socket_path=str(data_dir / "redis.sock"), decode_responses=True) as client:
            settings = client.config_get("append*")
            assert settings["appendonly"] == "yes"
            assert settings["appendfsync"] == "always"  # fsync before the reply, so before our 2xx
            assert assess(settings["appendonly"], settings["appendfsync"]) is None

            url = f"http://127.0.0.1:{port}/v1/stream/fsynced"
            marker = b"acknowledged-and-in-the-aof"
            for method, body in (("PUT", b""), ("POST", marker)):
                request = urllib.request.Request(
                    url, data=body, method=method, headers={"Content-Type": "text/plain"}
                )
                with urllib.request.urlopen(request) as r:
                    assert r.status in (201, 204)
            aof = b"".join(p.read_bytes() for p in data_dir.rglob("*.aof"))  # Redis 7: appendonlydir/
            assert marker in aof  # in the file when the 2xx came, not in a buffer of Redis'
            info = client.info("persistence")
            assert info["aof_enabled"] == 1
            assert info["aof_last_write_status"] == "ok"


@pytest.fixture
def external_redis(tmp_path: Path, request: pytest.FixtureRequest):
    """A redis-server with the persistence settings given as the test's parameters."""
    binary = redis_server_binary()
    appendonly, appendfsync, *more = request.param  # more: further redis-server arguments
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path),
         "--appendonly", appendonly, "--appendfsync", appendfsync, *more],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            try:
                with redis.Redis.from_url(url) as client:
                    client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.parametrize(
    "external_redis, why",
    [
        (("yes", "everysec"), "appendfsync is 'everysec'"),
        (("yes", "no"), "appendfsync is 'no'"),
        (("no", "always"), "appendonly is off"),
        (("no", "everysec"), "appendonly is off"),
    ],
    indirect=["external_redis"],
)
def test_require_durable_refuses_redis_without_fsync_always(external_redis: str, why: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--port", str(free_port()),
         "--redis-url", external_redis, "--require-durable"],
        capture_output=True, text=True, timeout=30, env=_env(),
    )  # fmt: skip
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("durable-streams: refusing to start (--require-durable): "), out.stderr
    assert why in last


@pytest.mark.parametrize("external_redis", [("yes", "always")], indirect=True)
def test_require_durable_accepts_fsync_always(external_redis: str) -> None:
    with _serving("--redis-url", external_redis, "--require-durable"):
        pass


@pytest.mark.parametrize(
    "appendonly, appendfsync, durable",
    [("yes", "always", True), ("yes", "everysec", False), ("yes", "no", False), ("no", "always", False)],
)
def test_assess(appendonly: str, appendfsync: str, durable: bool) -> None:
    assert (assess(appendonly, appendfsync) is None) is durable


def test_embedded_redis_never_evicts(tmp_path: Path) -> None:
    """Asked for explicitly (not left to a default or a config file): at maxmemory the
    embedded Redis refuses writes (503 to the client) rather than deleting streams."""
    redis_server_binary()
    command = EmbeddedRedis(tmp_path / "data").command()
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    data_dir = tmp_path / "data"
    with _serving("--data-dir", str(data_dir)):
        with redis.Redis(unix_socket_path=str(data_dir / "redis.sock"), decode_responses=True) as client:
            assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"


EVICTING = ("yes", "always", "--maxmemory-policy", "allkeys-lru")


@pytest.mark.parametrize("external_redis", [EVICTING], indirect=True)
def test_an_evicting_redis_is_warned_about(external_redis: str, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("w") as err, _serving("--redis-url", external_redis, stderr=err):
        pass
    warnings = [line for line in log.read_text().splitlines() if "WARNING" in line and "maxmemory" in line]
    assert len(warnings) == 1, log.read_text()
    assert "ACKNOWLEDGED DATA CAN BE LOST" in warnings[0] and "'allkeys-lru'" in warnings[0]
    assert "CONFIG SET maxmemory-policy noeviction" in warnings[0]


@pytest.mark.parametrize("external_redis", [EVICTING], indirect=True)
def test_require_durable_refuses_an_evicting_redis(external_redis: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--port", str(free_port()),
         "--redis-url", external_redis, "--require-durable"],
        capture_output=True, text=True, timeout=30, env=_env(),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("durable-streams: refusing to start (--require-durable): maxmemory-policy is "
                           "'allkeys-lru'"), out.stderr  # fmt: skip
    assert "CONFIG SET maxmemory-policy noeviction" in last


@pytest.mark.parametrize(
    "external_redis", [("yes", "always", "--rename-command", "CONFIG", "hidden-config")], indirect=True
)
async def test_a_redis_that_forbids_config_is_said_and_skipped(
    external_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Managed Redis often refuses CONFIG: the gateway says it could not check, and serves."""
    with caplog.at_level(logging.WARNING, logger="gateway.redis_io.durability"):
        gateway = await start_gateway(external_redis)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(gateway.make_url("/readyz")) as r:
                    assert r.status == 200
        finally:
            await gateway.close()
    said = " ".join(record.getMessage() for record in caplog.records)
    assert "could not read maxmemory-policy" in said and "make sure it is noeviction" in said


@pytest.mark.parametrize(
    "policy, safe",
    [("noeviction", True), ("allkeys-lru", False), ("volatile-lru", False), ("allkeys-random", False)],
)
def test_assess_eviction(policy: str, safe: bool) -> None:
    assert (assess_eviction(policy) is None) is safe
