"""Starting while Redis is away: gateways and archive workers come up anyway, say
so in one line per try (no traceback), answer /healthz 200 and /readyz 503 (stream
requests 503 + Retry-After), and serve once Redis is there, without a restart. A
check that refuses once Redis answers (here: a key layout of a newer build)
stops the server with one line and a non-zero exit code."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import redis

from gateway.cli.embedded import EmbeddedRedis
from gateway.redis_io import keys, layout

from .conftest import free_port, redis_server_binary, start_gateway, stop_gracefully

TEXT = {"Content-Type": "text/plain"}


@pytest.fixture(autouse=True)
def _needs_redis_server() -> None:
    redis_server_binary("needs a redis-server binary to start on a chosen port")


def _command(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``durable-streams <args>``, its output (stdout and stderr) to a file."""
    log = tmp_path / f"{args[0]}-{time.monotonic_ns()}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_") and k != "REDIS_URL"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    return proc, log


def _status(url: str, method: str = "GET", data: bytes | None = None) -> tuple[int, dict[str, str]]:
    request = urllib.request.Request(url, data=data, method=method, headers=TEXT)
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)
    except OSError:
        return 0, {}


def _retrying(url: str, method: str, data: bytes) -> int:
    """A write's status, sent again after each 503 as its Retry-After says (as a client
    does): with several workers, the readiness checks may all have reached the ready one
    while another still waits out its backoff (a 503 changed nothing)."""
    deadline = time.monotonic() + 15
    while True:
        status, headers = _status(url, method, data)
        if status != 503 or time.monotonic() > deadline:
            return status
        time.sleep(min(float(headers.get("Retry-After", "1")), 2.0))


def _wait_for(url: str, status: int, proc: subprocess.Popen[bytes], log: Path, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        if _status(url)[0] == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered {status}:\n{log.read_text()}")


def _assert_clean(log: Path) -> str:
    text = log.read_text()
    assert "Traceback" not in text, text
    assert not any(line.startswith((" ", "\t")) for line in text.splitlines()), text  # no continuation lines
    return text


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_starts_without_redis_and_serves_once_it_is_there(tmp_path: Path, workers: int) -> None:
    redis_port, port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    proc, log = _command(
        tmp_path, "serve", "--port", str(port), "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
        "--workers", str(workers),
    )  # fmt: skip
    server = EmbeddedRedis(tmp_path / "redis", port=redis_port)
    try:
        _wait_for(f"{base}/healthz", 200, proc, log)  # the process is alive and serving
        for _ in range(2 * workers):  # whichever worker answers
            assert _status(f"{base}/readyz")[0] == 503
            status, headers = _status(f"{base}/v1/stream/early", "PUT")
            assert status == 503 and int(headers["Retry-After"]) >= 1
        time.sleep(1.0)  # a few tries with backoff
        assert proc.poll() is None, log.read_text()  # gunicorn was not halted by a worker without Redis

        server.start()
        _wait_for(f"{base}/readyz", 200, proc, log)
        for _ in range(10 * workers):  # every worker is ready, not only the first to answer
            _wait_for(f"{base}/readyz", 200, proc, log, seconds=15)
        url = f"{base}/v1/stream/late"
        assert _retrying(url, "PUT", b"first ") == 201
        assert _retrying(url, "POST", b"second") == 204
        with urllib.request.urlopen(f"{url}?offset=-1", timeout=5) as r:
            assert r.read() == b"first second"
    finally:
        code = stop_gracefully(proc)
        server.stop()
    assert code == 0, log.read_text()
    text = _assert_clean(log)
    assert "redis not usable" in text and "Connection refused" in text


def test_archive_worker_waits_for_redis(tmp_path: Path) -> None:
    redis_port, metrics_port = free_port(), free_port()
    proc, log = _command(
        tmp_path, "archive", "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
        "--metrics-port", str(metrics_port), "--archive-url", str(tmp_path / "archive"),
        "--archive-interval", "0.2", "--archive-stall-seconds", "5", "--archive-lease-seconds", "5",
    )  # fmt: skip
    server = EmbeddedRedis(tmp_path / "redis", port=redis_port)
    try:
        health = f"http://127.0.0.1:{metrics_port}/healthz"
        _wait_for(health, 200, proc, log)  # waiting for Redis is what it should be doing
        time.sleep(6)  # longer than the stall limit: waiting is progress, not a stall
        assert _status(health)[0] == 200, log.read_text()
        server.start()
        client = redis.Redis(port=redis_port)
        deadline = time.monotonic() + 30
        while not client.exists(keys.ARCHIVE_WORKER_ALIVE):  # it announced itself: it runs
            assert time.monotonic() < deadline, log.read_text()
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        # the first process on an empty Redis stamps the layout
        assert client.get(keys.LAYOUT) == str(layout.CURRENT).encode()
        assert _status(health)[0] == 200
    finally:
        code = stop_gracefully(proc)
        server.stop()
    assert code == 0, log.read_text()
    text = _assert_clean(log)
    assert "redis not usable yet" in text


def _redis_holding_layout(data_dir: Path, port: int, version: int) -> EmbeddedRedis:
    """A stopped Redis whose files hold ``version`` as the key layout (written by a newer build)."""
    server = EmbeddedRedis(data_dir, port=port)
    server.start()
    redis.Redis(port=port).set(keys.LAYOUT, version)
    server.stop()  # the AOF (fsync always) keeps it
    return server


@pytest.mark.parametrize("workers", [1, 2])
def test_a_refusal_found_once_redis_answers_stops_the_server(tmp_path: Path, workers: int) -> None:
    redis_port, port = free_port(), free_port()
    server = _redis_holding_layout(tmp_path / "redis", redis_port, layout.CURRENT + 1)
    proc, log = _command(
        tmp_path, "serve", "--port", str(port), "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
        "--workers", str(workers),
    )  # fmt: skip
    try:
        _wait_for(f"http://127.0.0.1:{port}/readyz", 503, proc, log)
        server.start()
        code = proc.wait(60)
    finally:
        stop_gracefully(proc)
        server.stop()
    text = log.read_text()
    assert code != 0, text
    newer = (
        f"Redis holds key layout v{layout.CURRENT + 1}; this build understands up to v{layout.CURRENT}: "
        "upgrade the gateways/workers"
    )
    assert newer in text
    assert "Traceback" not in text, text
    if workers == 1:
        assert text.splitlines()[-1] == f"durable-streams: {newer}"


async def test_requests_needing_redis_get_503_until_it_is_ready(http: aiohttp.ClientSession) -> None:
    """In-process: a gateway whose Redis is not there answers for itself and says 'retry'."""
    gateway = await start_gateway(f"redis://127.0.0.1:{free_port()}/0")
    try:
        base = str(gateway.make_url(""))
        async with http.get(f"{base}/healthz") as r:
            assert r.status == 200
        async with http.get(f"{base}/readyz") as r:
            assert r.status == 503 and "waiting for storage" in await r.text()
        for method in ("PUT", "POST", "GET", "HEAD", "DELETE"):
            async with http.request(method, f"{base}/v1/stream/x", headers=TEXT) as r:
                assert r.status == 503, method
                assert int(r.headers["Retry-After"]) >= 1
        async with http.options(f"{base}/v1/stream/x") as r:  # a CORS preflight needs no Redis
            assert r.status in (200, 204)
    finally:
        await gateway.close()
