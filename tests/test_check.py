"""``durable-streams check`` against a real gateway: access control off and on."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp

from .conftest import free_port, start_gateway

CHECKER = "checker-token-0123456789"  # admin on _check/: create, append, read, delete
READER = "reader-token-01234567890"  # read on _check/ only


async def _check(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "check", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_check_passes_against_a_gateway(redis_url: str, http: aiohttp.ClientSession) -> None:
    gateway = await start_gateway(redis_url)
    base = str(gateway.make_url("/v1/stream"))
    try:
        code, out, err = await _check("--url", base)
        assert code == 0, err
        lines = out.splitlines()
        steps = ["create", "append", "read", "long-poll", "delete", "check"]
        assert [line.split()[0] for line in lines] == steps
        assert lines[3].startswith("long-poll  woken by an append: 200")
        assert lines[-1] == f"check passed: {base}"
        stream = lines[0].split()[1].rstrip(":")
        assert stream.startswith(f"{base}/_check/")
        async with http.head(stream) as r:
            assert r.status in (404, 410)  # deleted
        code, out, _ = await _check("--url", base, "--path", "ops/probe/")
        assert code == 0 and f"{base}/ops/probe/" in out
    finally:
        await gateway.close()


async def test_check_with_access_control(redis_url: str, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [
        {"name": "checker", "token": CHECKER, "grants": "admin:_check/"},
        {"name": "reader", "token": READER, "grants": "read:_check/"},
    ]}))  # fmt: skip
    (tmp_path / "checker").write_text(CHECKER + "\n")
    (tmp_path / "reader").write_text(READER)
    gateway = await start_gateway(redis_url, auth_tokens_file=str(tokens))
    base = str(gateway.make_url("/v1/stream"))
    try:
        code, out, err = await _check("--url", base, "--token-file", str(tmp_path / "checker"))
        assert code == 0 and out.endswith(f"check passed: {base}\n"), err

        code, out, err = await _check("--url", base)  # no token: refused
        assert code == 1 and out == "" and err.count("\n") == 1, err
        assert err.startswith("check failed at create: 401") and "access control is on" in err

        code, out, err = await _check("--url", base, "--allow-refusal")  # what a chart without a token runs
        assert code == 0 and out.startswith("check passed: access control is on (create: 401"), out + err

        # A token that may not write fails, --allow-refusal or not: it was meant to pass.
        reader = str(tmp_path / "reader")
        code, out, err = await _check("--url", base, "--token-file", reader, "--allow-refusal")
        assert code == 1 and err.startswith("check failed at create: 403"), err

        code, _, err = await _check("--url", base, "--token-file", str(tmp_path / "missing"))
        assert code == 1 and err.startswith("check failed: token file: ") and err.count("\n") == 1
    finally:
        await gateway.close()


async def test_check_fails_in_one_line_when_nothing_answers() -> None:
    code, out, err = await _check("--url", f"http://127.0.0.1:{free_port()}/v1/stream", "--timeout", "5")
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith("check failed at create: no answer from http://127.0.0.1:")


async def test_check_reports_a_gateway_without_redis(redis_url: str) -> None:
    gateway = await start_gateway(f"redis://127.0.0.1:{free_port()}/0")
    try:
        code, _, err = await _check("--url", str(gateway.make_url("/v1/stream")))
        assert code == 1 and err.startswith("check failed at create: 503") and "expected 201" in err, err
    finally:
        await gateway.close()
