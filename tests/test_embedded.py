"""The embedded Redis is supervised: `durable-streams serve` restarts it when it
dies (its AOF replays every acknowledged write), `/healthz` answers 503 while it
is down, and a Redis that keeps dying makes the server exit non-zero with one
line saying why, for a process supervisor (systemd, Kubernetes) to act on.

Real processes throughout: the CLI as a user runs it, and a real redis-server
child that the tests SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.cli.embedded import EmbeddedRedis
from gateway.config import Settings
from gateway.http.app import create_app

from .conftest import free_port, own_redis_server, read_all, redis_server_binary, stop_gracefully

TEXT = {"Content-Type": "text/plain"}


@pytest.fixture(autouse=True)
def _needs_redis_server() -> None:
    redis_server_binary("needs a redis-server binary to kill")


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, int, Path]:
    """``durable-streams serve`` on an embedded Redis; its log goes to a file (no pipe to fill)."""
    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DURABLE_STREAMS_REDIS_URL")}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port),
             "--data-dir", str(tmp_path / "data"), *args],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc, port, log
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("gateway did not become ready:\n" + log.read_text())


def _wait_for_workers(log: Path, workers: int) -> None:
    """Every worker has connected (a worker that cannot reach Redis while it boots
    stops gunicorn: "Worker failed to boot")."""
    for _ in range(300):
        if log.read_text().count("redis persistence:") >= workers:
            return
        time.sleep(0.1)
    raise AssertionError("workers did not all start:\n" + log.read_text())


def _redis_pid(proc: subprocess.Popen, data_dir: Path) -> int:
    """The redis-server child of ``proc`` (the gunicorn master with workers) serving ``data_dir``."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in children:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "redis-server" in cmdline and str(data_dir.resolve()) in cmdline:
            return int(pid)
    raise AssertionError(f"no redis-server child of {proc.pid}: {children}")


async def _status(http: aiohttp.ClientSession, url: str) -> int:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status
    except (TimeoutError, aiohttp.ClientError):
        return 0


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_killed_embedded_redis_is_restarted(tmp_path: Path, workers: int) -> None:
    """SIGKILL the embedded redis-server under appends: /healthz goes 503, the
    server restarts Redis on the same files, /healthz is 200 again, appends
    work again with no intervention, and every acknowledged append is there
    once, in order. One WARNING line for the restart."""
    proc, port, log = _start(tmp_path, "--workers", str(workers))
    _wait_for_workers(log, workers)
    data_dir = tmp_path / "data"
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/v1/stream/phoenix"
    acked: list[bytes] = []
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.put(url, headers=TEXT) as r:
                assert r.status == 201

            async def writer(n: int) -> None:
                i = 0
                while not stop.is_set():
                    item = f"[{n}:{i}]".encode()
                    i += 1  # never retried: each item is posted once, so it may be stored once at most
                    try:
                        async with http.post(url, data=item, headers=TEXT) as r:
                            if r.status == 204:
                                acked.append(item)
                                continue
                            assert r.status in (503, 504), r.status  # unavailable; outcome unknown
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.05)

            writers = [asyncio.create_task(writer(n)) for n in range(4)]
            await asyncio.sleep(0.5)
            first = _redis_pid(proc, data_dir)
            os.kill(first, signal.SIGKILL)
            statuses: list[int] = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                statuses.append(await _status(http, f"{base}/healthz"))
                if 503 in statuses and statuses[-1] == 200:
                    break
                await asyncio.sleep(0.02)
            assert 503 in statuses, f"/healthz never reported the dead Redis: {statuses[:5]}"
            assert statuses[-1] == 200, f"/healthz did not recover: {statuses[-5:]}"
            assert set(statuses) <= {200, 503}, statuses  # the gateway itself stayed up
            second = _redis_pid(proc, data_dir)
            assert second != first

            restarted = len(acked)
            for _ in range(200):  # the gateway's clients reconnect by themselves
                if len(acked) >= restarted + 20:
                    break
                await asyncio.sleep(0.05)
            assert len(acked) >= restarted + 20, "appends did not work again after the restart"
            assert await _status(http, f"{base}/readyz") == 200
            stop.set()
            await asyncio.wait_for(asyncio.gather(*writers), 30)
            stored = await read_all(http, url)
    finally:
        stop.set()
        code = stop_gracefully(proc)
    assert code == 0, log.read_text()
    assert [item for item in acked if item not in stored] == []
    for n in range(4):
        mine = [item for item in acked if item.startswith(f"[{n}:".encode())]
        positions = [stored.index(item) for item in mine]
        assert positions == sorted(positions)
        assert all(stored.count(item) == 1 for item in mine)
    lines = log.read_text().splitlines()
    restarts = [line for line in lines if "WARNING" in line and "embedded redis-server" in line]
    assert len(restarts) == 1, "\n".join(restarts)
    assert "restart" in restarts[0]


def _break_the_aof(data_dir: Path) -> None:
    """Make the data dir unusable: redis-server refuses to start on a corrupt AOF."""
    manifests = list((data_dir / "appendonlydir").glob("*.manifest"))  # Redis 7
    target = manifests[0] if manifests else data_dir / "appendonly.aof"  # Redis 6.2
    target.write_bytes(b"this is not an append-only file\n")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_redis_that_keeps_dying_stops_the_server(tmp_path: Path, workers: int) -> None:
    """A Redis that cannot come back: a bounded number of restarts (with
    backoff), then the server exits non-zero, its last line saying why."""
    proc, port, log = _start(tmp_path, "--workers", str(workers))
    _wait_for_workers(log, workers)
    data_dir = tmp_path / "data"
    try:
        _break_the_aof(data_dir)
        os.kill(_redis_pid(proc, data_dir), signal.SIGKILL)
        started = time.monotonic()
        code = proc.wait(60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code != 0, text
    assert took < 40, took
    last = text.strip().splitlines()[-1]
    assert last.startswith("durable-streams: embedded redis-server"), text
    assert "giving up" in last and "redis.log" in last, last
    restarts = [line for line in text.splitlines() if "WARNING" in line and "embedded redis-server" in line]
    assert len(restarts) == 5, "\n".join(restarts)  # the default: 5 restarts within 60 s
    assert not _redis_running(data_dir), "a redis-server was left running"


def _redis_running(data_dir: Path) -> bool:
    """Whether any redis-server process serves ``data_dir``."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace") if proc.name.isdigit() else ""
        except OSError:
            continue
        if "redis-server" in cmdline and str(data_dir.resolve()) in cmdline:
            return True
    return False


async def test_healthz_follows_the_embedded_redis_only(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """An app told its Redis is embedded answers /healthz 503 while that Redis is
    down; an app on an external Redis stays live (a Redis outage must not restart
    every gateway) and only /readyz reports it."""
    with own_redis_server(tmp_path / "redis") as redis_server:
        embedded = TestServer(create_app(Settings(), redis_server.url, embedded=True), port=free_port())
        external = TestServer(create_app(Settings(), redis_server.url), port=free_port())
        await embedded.start_server()
        await external.start_server()
        try:
            for server in (embedded, external):
                assert await _status(http, str(server.make_url("/healthz"))) == 200
            redis_server.kill()
            assert await _status(http, str(embedded.make_url("/healthz"))) == 503
            assert await _status(http, str(external.make_url("/healthz"))) == 200
            assert await _status(http, str(external.make_url("/readyz"))) == 503
            redis_server.start()
            assert await _status(http, str(embedded.make_url("/healthz"))) == 200  # a fresh connection
            for server in (embedded, external):
                assert await _status(http, str(server.make_url("/healthz"))) == 200
                for _ in range(50):  # the pool's connections from before the restart are replaced
                    if await _status(http, str(server.make_url("/readyz"))) == 200:
                        break
                    await asyncio.sleep(0.1)
                assert await _status(http, str(server.make_url("/readyz"))) == 200
        finally:
            await embedded.close()
            await external.close()


def test_supervisor_restarts_then_gives_up(tmp_path: Path) -> None:
    """The supervisor on its own, with short delays: a killed Redis comes back
    with its data; one that cannot start is retried ``max_restarts`` times in the
    window, then ``on_give_up`` gets one line saying why."""
    import threading

    import redis

    from gateway.cli.embedded import Supervisor

    server = EmbeddedRedis(tmp_path / "data")
    server.start()
    gave_up: list[str] = []
    done = threading.Event()

    def give_up(reason: str) -> None:
        gave_up.append(reason)
        done.set()

    supervisor = Supervisor(server, give_up, max_restarts=3, window=30.0, first_delay=0.05, max_delay=0.2)
    supervisor.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("k", "acked")
        first = server.process.pid
        server.kill()
        for _ in range(100):
            try:
                if client.get("k") == b"acked":
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass
            time.sleep(0.05)
        assert client.get("k") == b"acked"
        assert server.process.pid != first
        client.close()

        _break_the_aof(server.data_dir)
        server.kill()
        assert done.wait(30), "the supervisor never gave up"
    finally:
        supervisor.stop()
    (reason,) = gave_up
    assert "\n" not in reason and "giving up" in reason
    assert server.process.poll() is not None
