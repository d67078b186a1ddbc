"""The command line as a user runs it: embedded Redis, serve, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from gateway.embedded import find_redis_server

from .conftest import free_port


def test_help_lists_every_setting() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--redis-url", "--data-dir", "--max-body-bytes", "--require-durable"):
        assert flag in out.stdout
    assert "DURABLE_STREAMS_REDIS_URL" in out.stdout


def _wait_ready(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("gateway did not become ready")


def test_serve_with_embedded_redis(tmp_path) -> None:
    try:
        find_redis_server()
    except RuntimeError:
        pytest.skip("no redis-server binary")
    port = free_port()
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DURABLE_STREAMS_REDIS_URL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(data_dir)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_ready(port, proc)
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


def test_require_durable_refuses_risky_redis(tmp_path) -> None:
    try:
        binary = find_redis_server()
    except RuntimeError:
        pytest.skip("no redis-server binary")
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
