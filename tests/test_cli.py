"""The command line as a user runs it: embedded Redis, serve, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from gateway.protocol import offsets

from .conftest import free_port, redis_server_binary, wait_ready


def test_help_lists_every_setting() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--redis-url", "--data-dir", "--max-body-bytes", "--require-durable"):
        assert flag in out.stdout
    assert "DURABLE_STREAMS_REDIS_URL" in out.stdout


def _serve(tmp_path, *args: str, **extra_env: str) -> tuple[subprocess.Popen, int]:
    """``durable-streams serve`` with an embedded Redis, as a user starts it."""
    redis_server_binary("no redis-server binary")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DURABLE_STREAMS_REDIS_URL")}
    env.update(extra_env)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            *args,
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_ready(port, proc)
    return proc, port


def test_serve_with_embedded_redis(tmp_path) -> None:
    proc, port = _serve(tmp_path)
    data_dir = tmp_path / "data"
    try:
        base = f"http://127.0.0.1:{port}/v1/stream/cli"
        put = urllib.request.Request(base, data=b"hi", method="PUT", headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(put) as r:
            assert r.status == 201
        with urllib.request.urlopen(base) as r:
            assert r.read() == b"hi"
        assert (data_dir / "redis.sock").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert not (data_dir / "redis.sock").exists()  # the embedded Redis was stopped too
    assert any(p.name.startswith("appendonly") for p in data_dir.iterdir())


def test_workers_share_one_port(tmp_path) -> None:
    """Also: a flag wins over a bad variable under gunicorn too, and gunicorn writes nothing
    under $HOME (its control socket is off: read-only in containers)."""
    home = tmp_path / "home"
    home.mkdir()
    proc, port = _serve(tmp_path, "--workers", "2", HOME=str(home), XDG_RUNTIME_DIR="",
                        DURABLE_STREAMS_PORT="not-a-port")  # fmt: skip
    try:
        assert not list(home.iterdir()), "gunicorn wrote under $HOME"
        workers: list[str] = []
        for _ in range(100):  # the first worker may answer before the second has booted
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
            workers = [c for c in children.stdout.split() if "redis" not in open(f"/proc/{c}/cmdline").read()]
            if len(workers) == 2:
                break
            time.sleep(0.1)
        assert len(workers) == 2
        base = f"http://127.0.0.1:{port}/v1/stream/workers"
        put = urllib.request.Request(base, data=b"a", method="PUT", headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(put) as r:
            assert r.status == 201
        for _ in range(20):  # connections land on either worker; all see one Redis
            post = urllib.request.Request(
                base, data=b"b", method="POST", headers={"Content-Type": "text/plain"}
            )
            with urllib.request.urlopen(post) as r:
                assert r.status == 204
        with urllib.request.urlopen(base) as r:
            assert r.read() == b"a" + b"b" * 20
        # /metrics adds up the workers (multiprocess mode), whichever worker answers.
        for _ in range(4):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            assert sum(s.value for s in families["ds_appends"].samples if s.name == "ds_appends_total") == 20
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0


async def test_sigterm_ends_live_reads_cleanly(tmp_path) -> None:
    """On SIGTERM, SSE ends with a control event carrying the offset and
    long-polls get their normal empty answer, well before their timeouts."""
    import asyncio

    import aiohttp

    proc, port = _serve(tmp_path, "--long-poll-timeout", "30", "--sse-cycle-seconds", "60")
    base = f"http://127.0.0.1:{port}/v1/stream/drain"
    try:
        async with aiohttp.ClientSession() as http:
            await http.put(base, data=b"x", headers={"Content-Type": "text/plain"})
            poll = asyncio.create_task(http.get(base, params={"offset": "now", "live": "long-poll"}))
            sse = await http.get(base, params={"offset": "-1", "live": "sse"})
            await sse.content.readuntil(b"upToDate")
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            rest = (await asyncio.wait_for(sse.content.read(), 10)).decode()
            r = await asyncio.wait_for(poll, 10)
            assert r.status == 204
            assert r.headers["Stream-Next-Offset"] == offsets.encode(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert "event: control" in rest and offsets.encode(1) in rest


def test_require_durable_refuses_risky_redis(tmp_path) -> None:
    binary = redis_server_binary("no redis-server binary")
    redis_port = free_port()
    redis = subprocess.Popen(
        [binary, "--port", str(redis_port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--port",
                str(free_port()),
                "--redis-url",
                f"redis://127.0.0.1:{redis_port}/0",
                "--require-durable",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode != 0
        assert "appendonly is off" in out.stderr
    finally:
        redis.terminate()
        redis.wait()


async def test_two_gateway_processes_serve_one_stream(tmp_path, redis_url: str) -> None:
    """Two separate gateway processes on one Redis: append through one, read
    live (long-poll and SSE) through the other, up to EOF."""
    import asyncio
    import uuid

    import aiohttp

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, port_a = _serve(tmp_path / "a", "--redis-url", redis_url)
    b, port_b = _serve(tmp_path / "b", "--redis-url", redis_url)
    name = f"procs-{uuid.uuid4().hex[:8]}"
    url_a, url_b = (f"http://127.0.0.1:{port}/v1/stream/{name}" for port in (port_a, port_b))
    json_type = {"Content-Type": "application/json"}
    try:
        async with aiohttp.ClientSession() as http:
            await http.put(url_a, headers=json_type)
            poll = asyncio.create_task(http.get(url_b, params={"offset": "-1", "live": "long-poll"}))
            sse = await http.get(url_b, params={"offset": "-1", "live": "sse"})
            await sse.content.readuntil(b"upToDate")
            await asyncio.sleep(0.3)
            await http.post(url_a, data=b'[{"n":1}]', headers=json_type)
            r = await asyncio.wait_for(poll, 5)
            assert await r.json() == [{"n": 1}]
            await http.post(url_a, data=b'{"n":2}', headers={**json_type, "Stream-Closed": "true"})
            rest = (await asyncio.wait_for(sse.content.read(), 5)).decode()
            assert '[{"n":1}]' in rest and '[{"n":2}]' in rest and '"streamClosed":true' in rest
    finally:
        for proc in (a, b):
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)


def test_serve_takes_the_hard_open_files_limit() -> None:
    """SSE clients each hold a descriptor: a soft limit of 1024 (containerd 2's default)
    would refuse clients far below --max-live-connections."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    script = (
        "import resource; from gateway.cli import main; main.raise_fd_limit(); "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    lowered = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard})); "
    out = subprocess.run([sys.executable, "-c", lowered + script], capture_output=True, text=True, check=True)
    assert int(out.stdout) == hard
