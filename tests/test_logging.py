"""--log-format json (one object per line: ts, level, logger, message, fields) and
--access-log (one line per request, secrets in the query redacted), in one process,
under gunicorn and for the archive worker."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from gateway.http.accesslog import redacted_target

from .conftest import free_port, start_gateway, wait_ready

SECRET = "c2VjcmV0LXNpZ25hdHVyZQ"


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{args[0]}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_") and k != "REDIS_URL"}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", *args], env=env, stderr=err)
    return proc, log


def _request(url: str, method: str = "GET", data: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "text/plain"})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _json_lines(log: Path) -> list[dict]:
    lines = log.read_text().splitlines()
    assert lines
    records = []
    for line in lines:
        record = json.loads(line)  # every line is one JSON object
        assert {"ts", "level", "logger", "message"} <= record.keys(), line
        assert record["ts"].endswith("Z") and record["level"] in ("debug", "info", "warning", "error")
        records.append(record)
    return records


@pytest.mark.parametrize("workers, level", [(1, "warning"), (2, "info")])
def test_json_logs_and_the_access_log(tmp_path: Path, redis_url: str, workers: int, level: str) -> None:
    port = free_port()
    proc, log = _start(
        tmp_path, "serve", "--port", str(port), "--redis-url", redis_url, "--workers", str(workers),
        "--log-format", "json", "--access-log", "--log-level", level,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1/stream/logged-{workers}-{time.monotonic_ns()}"
    try:
        wait_ready(port, proc)
        assert _request(base, "PUT", b"hello") == 201
        signed = f"offset=-1&ds_scope=read&ds_expires=99&ds_by=ab&ds_sig={SECRET}&access_token={SECRET}"
        assert _request(f"{base}?{signed}") == 200
        assert _request(f"{base}?{SECRET}") == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    records = _json_lines(log)
    assert SECRET not in log.read_text()
    access = [r for r in records if r["logger"] == "durable_streams.access"]
    put = next(r for r in access if r["method"] == "PUT")
    assert put["status"] == 201 and put["path"] == base.split(str(port))[1] and put["remote"] == "127.0.0.1"
    assert put["bytes"] == 0 and put["duration_ms"] >= 0 and put["level"] == "info"  # at any --log-level
    read = next(r for r in access if "ds_sig" in r["path"])
    assert read["status"] == 200 and read["bytes"] == 5
    assert read["path"].endswith(
        "?offset=-1&ds_scope=read&ds_expires=99&ds_by=ab&ds_sig=REDACTED&access_token=REDACTED"
    )
    assert any(r["path"].endswith("?REDACTED") for r in access)
    if workers > 1:  # gunicorn's own lines go the same way
        assert any(r["logger"] == "gunicorn.error" and "Booting worker" in r["message"] for r in records)


async def test_the_access_log_is_off_by_default_and_text_says_it_all(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    quiet = await start_gateway(redis_url)
    logged = await start_gateway(redis_url, access_log=True)
    try:
        with caplog.at_level(logging.INFO, logger="durable_streams.access"):
            async with aiohttp.ClientSession() as http:
                for server in (quiet, logged):
                    async with http.get(server.make_url("/v1/stream/nothing-here?offset=-1&x=1")) as r:
                        assert r.status == 404
    finally:
        await quiet.close()
        await logged.close()
    (record,) = [r for r in caplog.records if r.name == "durable_streams.access"]
    assert record.getMessage().startswith('127.0.0.1 "GET /v1/stream/nothing-here?offset=-1&x=REDACTED" 404 ')
    assert record.getMessage().endswith("ms")


async def test_appends_answered_on_the_connection_are_logged_as_any_request(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """http/fastpath.py's appends (and their refusals) in the access log, the same line as
    aiohttp's path writes for them (but the duration)."""
    from gateway.telemetry import metrics

    lines = []
    for fast in (True, False):
        server = await start_gateway(redis_url, access_log=True, fast_appends=fast)
        name = f"logged-append-{fast}-{time.monotonic_ns()}"
        url = server.make_url(f"/v1/stream/{name}")
        metrics.flush_requests()
        before = metrics.FAST_PATH._value.get()
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger="durable_streams.access"):
                async with aiohttp.ClientSession() as http:
                    async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
                        assert r.status == 201
                    async with http.post(url, data=b"hello", headers={"Content-Type": "text/plain"}) as r:
                        assert r.status == 204
                    async with http.post(url, data=b"[1]", headers={"Content-Type": "application/json"}) as r:
                        assert r.status == 409
        finally:
            await server.close()
        metrics.flush_requests()
        assert metrics.FAST_PATH._value.get() - before == (2 if fast else 0)
        messages = [r.getMessage() for r in caplog.records if r.name == "durable_streams.access"]
        lines.append([m.replace(name, "NAME").rsplit(" ", 1)[0] for m in messages])  # less the duration
    assert lines[0] == lines[1]
    assert lines[0][1:] == ['127.0.0.1 "POST /v1/stream/NAME" 204 0', lines[0][2]]
    assert lines[0][2].startswith('127.0.0.1 "POST /v1/stream/NAME" 409 ')


def test_archive_worker_logs_json(tmp_path: Path) -> None:
    proc, log = _start(
        tmp_path, "archive", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--log-format", "json",
        "--archive-url", str(tmp_path / "archive"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "redis not usable yet" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    records = _json_lines(log)
    assert any(r["level"] == "warning" and "Connection refused" in r["message"] for r in records)


@pytest.mark.parametrize(
    "path, query, logged",
    [
        ("/v1/stream/a", "", "/v1/stream/a"),
        ("/v1/stream/a", "offset=-1&live=sse&cursor=7", "/v1/stream/a?offset=-1&live=sse&cursor=7"),
        ("/v1/stream/a", "ds_sig=abc&ds_expires=1", "/v1/stream/a?ds_sig=REDACTED&ds_expires=1"),
        ("/v1/stream/a", "token=abc&&offset=now", "/v1/stream/a?token=REDACTED&&offset=now"),
        ("/v1/stream/a%20b", "secretword", "/v1/stream/a%20b?REDACTED"),
        ("/v1/stream/a", "ds%5Fsig=abc", "/v1/stream/a?ds%5Fsig=REDACTED"),
    ],
)
def test_redacted_target(path: str, query: str, logged: str) -> None:
    assert redacted_target(path, query) == logged


def test_json_lines_survive_awkward_extra_fields() -> None:
    """orjson refuses non-string keys and ints beyond 64 bits: the line must still be written."""
    import logging

    import orjson

    from gateway.telemetry.logs import JsonFormatter

    record = logging.LogRecord("x", logging.INFO, "f", 1, "hi", (), None)
    record.mapping, record.big = {1: 2}, 2**70
    line = orjson.loads(JsonFormatter().format(record))
    assert line["message"] == "hi" and "1180591620717411303424" in str(line["big"])
