"""The command-line client (gateway/cli/client*.py) and ``doctor`` against a real gateway
and Redis: in-process through ``main`` (in a thread: it runs its own event loop), and
``tail`` as a process of its own (it runs until the stream closes, or SIGINT)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.cli import client_read
from gateway.cli.embedded import EmbeddedRedis
from gateway.cli.main import build_parser, main
from gateway.protocol import offsets
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy
from workers.compactor import CompactionPolicy

from .conftest import free_port, serving, start_gateway

TOKEN = "cli-writer-token-0123456789"


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DURABLE_STREAMS_URL", "DURABLE_STREAMS_TOKEN", "DURABLE_STREAMS_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)


class Cli:
    """``durable-streams ...`` in-process: (exit code, stdout bytes, stderr text)."""

    def __init__(self, capsys: pytest.CaptureFixture[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
        self.capsys, self.monkeypatch = capsys, monkeypatch

    async def __call__(self, *args: str, stdin: bytes = b"") -> tuple[int, bytes, str]:
        self.monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))

        def run() -> int:
            try:
                return main(list(args))
            except SystemExit as exc:  # argparse: usage
                return int(exc.code or 0)

        code = await asyncio.to_thread(run)
        out, err = self.capsys.readouterr()
        return code, out, err.decode()


@pytest.fixture
def cli(capsysbinary: pytest.CaptureFixture[bytes], monkeypatch: pytest.MonkeyPatch) -> Cli:
    return Cli(capsysbinary, monkeypatch)


def _name() -> str:
    return f"cli-{uuid.uuid4().hex[:10]}"


async def test_create_append_info_cat(cli: Cli, gateway: str) -> None:
    name = _name()
    code, out, _ = await cli(
        "create", name, "--url", gateway, "--content-type", "text/plain", "--ttl", "600", "a"
    )
    assert code == 0 and out.startswith(b"created ")
    code, out, _ = await cli(
        "create", name, "--url", gateway, "--content-type", "text/plain", "--ttl", "600", "a"
    )
    assert code == 0 and out.startswith(b"exists ")  # idempotent
    code, out, _ = await cli("append", f"{gateway}/{name}", "b", "c")  # a full URL; joined by newlines
    assert code == 0 and out.strip() == offsets.encode(4).encode()
    payload = bytes(range(256)) * 2  # longer than the gateway's 64-byte chunks: several reads
    code, out, err = await cli(
        "append", name, "--url", gateway, "--content-type", "text/plain", stdin=payload
    )
    assert code == 0, err
    code, out, _ = await cli("cat", name, "--url", gateway)
    assert code == 0 and out == b"ab\nc" + payload
    code, out, _ = await cli("cat", name, "--url", gateway, "--offset", offsets.encode(2))
    assert out == b"\nc" + payload
    code, out, _ = await cli("info", name, "--url", gateway)
    assert code == 0
    assert b"content-type: text/plain" in out and b"closed:       no" in out and b"ttl:          600 s" in out
    code, out, _ = await cli("info", name, "--url", gateway, "--json")
    found = json.loads(out)
    assert found["next_offset"] == offsets.encode(4 + len(payload))
    assert found["closed"] is False and found["ttl"] == 600 and found["expires_at"] is None


async def test_info_of_a_compacted_stream(
    cli: Cli, gateway: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    name = _name()
    events = [
        {"type": "t", "key": "k", "value": {"v": n}, "headers": {"operation": "upsert"}} for n in range(4)
    ]
    async with aiohttp.ClientSession() as http:
        headers = {"Content-Type": "application/json", "Stream-Compaction": "state"}
        async with http.put(f"{gateway}/{name}", data=json.dumps(events), headers=headers) as r:
            assert r.status == 201
    code, out, _ = await cli("info", name, "--url", gateway)
    said = dict(line.split(":", 1) for line in out.decode().splitlines() if not line.startswith("url:"))
    assert code == 0 and said["compaction"].strip() == "state" and said["last-compacted"].strip() == "-", out
    policy = Policy(hot_bytes=1 << 40)
    archiver = Archiver(redis, Archive(str(tmp_path)), policy, compaction=CompactionPolicy(0, 0, 0))
    await archiver.archive_stream(keys.stream_id(name))
    code, out, _ = await cli("info", name, "--url", gateway, "--json")
    found = json.loads(out)
    assert found["compaction"] == "state" and found["dropped"].startswith("3 messages"), found
    assert found["compaction_ratio"] > 3 and found["last_compacted"], found


async def test_ls_pages_through_every_stream(cli: Cli, gateway: str) -> None:
    prefix = _name()
    names = [f"{prefix}/{n:04d}" for n in range(1, 2504)]  # three pages of 1,000
    async with aiohttp.ClientSession() as http:
        for start in range(0, len(names), 200):
            await asyncio.gather(
                *(
                    http.put(f"{gateway}/{n}", headers={"Content-Type": "text/plain"})
                    for n in names[start : start + 200]
                )
            )
    code, out, err = await cli("ls", prefix, "--url", gateway)
    assert (code, err) == (0, "") and out.decode().splitlines() == names
    code, out, _ = await cli("ls", f"{prefix}/", "--url", gateway, "--limit", "3", "--json")
    items = [json.loads(line) for line in out.decode().splitlines()]
    assert code == 0 and [i["path"] for i in items] == names[:3] and items[0]["status"] == "open"
    code, out, _ = await cli("ls", f"{prefix}/0001", "-l", "--url", gateway)
    assert code == 0 and out.decode().split() == [
        "open",
        "0",
        out.decode().split()[2],
        "text/plain",
        names[0],
    ]
    code, out, err = await cli("ls", "--url", f"{gateway}/nowhere-{prefix}")
    assert code == 3 and err.startswith("durable-streams ls: 404"), err


async def test_json_streams(cli: Cli, gateway: str) -> None:
    name = _name()
    assert (await cli("create", name, "--url", gateway, "--content-type", "application/json"))[0] == 0
    code, _, err = await cli("append", name, "--url", gateway, '{"n": 1}', '"two"')  # type from HEAD
    assert code == 0, err
    await cli("append", name, "--url", gateway, stdin=b'[{"n": 3}, [4]]')
    code, out, _ = await cli("cat", name, "--url", gateway, "--json-lines")
    assert out == b'{"n":1}\n"two"\n{"n":3}\n[4]\n'
    code, out, _ = await cli("cat", name, "--url", gateway)
    assert json.loads(out) == [{"n": 1}, "two", {"n": 3}, [4]]


async def test_producer_retries_are_deduplicated(cli: Cli, gateway: str) -> None:
    name = _name()
    await cli("create", name, "--url", gateway, "--content-type", "text/plain")
    producer = ("--producer-id", "p1", "--epoch", "1", "--seq", "0", "--json")
    first = json.loads((await cli("append", name, "--url", gateway, *producer, "once"))[1])
    again = json.loads((await cli("append", name, "--url", gateway, *producer, "once"))[1])
    assert first["duplicate"] is False and again["duplicate"] is True
    assert again["next_offset"] == first["next_offset"]
    assert (await cli("cat", name, "--url", gateway))[1] == b"once"
    # a stale epoch is fenced (403 with Producer-Epoch): a conflict, not an access refusal
    code, _, err = await cli("append", name, "--url", gateway, "--producer-id", "p1", "--epoch", "0", "x")
    assert code == 4 and err.startswith("durable-streams append: 403")
    assert (await cli("append", name, "--url", gateway, "--seq", "1", "x"))[0] == 2  # --seq needs an id


async def test_fork_close_rm(cli: Cli, gateway: str) -> None:
    source, copy = _name(), _name()
    await cli("create", source, "--url", gateway, "--content-type", "text/plain", "hello world")
    code, out, err = await cli(
        "fork",
        copy,
        "--from",
        source,
        "--url",
        gateway,
        "--offset",
        "0000000000000000_0000000000000005",  # format 0, as minted before: still read
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["created"] is True
    await cli("append", copy, "--url", gateway, "!")
    assert (await cli("cat", copy, "--url", gateway))[1] == b"hello!"
    code, out, _ = await cli("close", source, "--url", gateway, "--json")
    assert code == 0 and json.loads(out) == {
        "url": f"{gateway}/{source}",
        "closed": True,
        "next_offset": offsets.encode(11),
    }
    assert b"closed:       yes" in (await cli("info", source, "--url", gateway))[1]
    code, _, err = await cli("append", source, "--url", gateway, "late")
    assert code == 4 and err.startswith("durable-streams append: 409 Conflict")
    code, out, _ = await cli("append", copy, "--url", gateway, "--close", "end", "--json")
    assert json.loads(out)["closed"] is True
    code, out, _ = await cli("rm", copy, "--url", gateway, "--json")
    assert code == 0 and json.loads(out)["deleted"] is True
    code, _, err = await cli("info", copy, "--url", gateway)
    assert code == 3 and "404" in err and len(err.strip().splitlines()) == 1


async def test_exit_codes(cli: Cli, gateway: str, redis_url: str, tmp_path: Path) -> None:
    assert (await cli("cat", "nothing-here", "--url", gateway))[0] == 3
    name = _name()
    await cli("create", name, "--url", gateway)
    code, _, err = await cli("cat", name, "--url", gateway, "--offset", "bogus")
    assert code == 7 and "400" in err and "offset" in err
    code, _, err = await cli("info", name, "--url", f"http://127.0.0.1:{free_port()}/v1/stream")
    assert code == 6 and "cannot reach" in err
    assert (await cli("info"))[0] == 2  # no STREAM
    assert (
        await cli("create", name, "--url", gateway, "--ttl", "5", "--expires-at", "2030-01-01T00:00:00Z")
    )[0] == 2
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"name": "w", "token": TOKEN, "grants": "admin:cli/"}]}))
    (tmp_path / "token").write_text(TOKEN + "\n")
    async with serving(redis_url, auth_tokens_file=str(tokens)) as secured:
        code, _, err = await cli("create", "cli/x", "--url", secured, "--token", "wrong-token-0123456789")
        assert code == 5 and err.startswith("durable-streams create: 401")
        assert (await cli("create", "cli/x", "--url", secured))[0] == 5
        code, _, err = await cli(
            "create", f"cli/{_name()}", "--url", secured, "--token-file", str(tmp_path / "token")
        )
        assert code == 0, err


def _origin(url: str) -> str:
    """The server's address: scheme and host of ``url``, no path."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _note(command: str, base: str) -> str:
    return (
        f"durable-streams {command}: note: using {base} (the server's stream prefix); "
        "pass it as --url to skip this check\n"
    )


async def test_server_address_as_url_finds_the_prefix(cli: Cli, gateway: str) -> None:
    """--url the server's address (issue 26): every command goes to the streams' prefix,
    said once on stderr; nothing is sent to the root's bucket routes (where ls answered
    400 "'__ds' is the name of one of the server's routes", exit 7)."""
    origin, name = _origin(gateway), _name()
    assert (await cli("create", name, "--url", gateway, "--content-type", "text/plain", "hi"))[0] == 0
    code, out, err = await cli("ls", name, "--url", origin)
    assert (code, out, err) == (0, f"{name}\n".encode(), _note("ls", gateway))
    code, out, err = await cli("info", name, "--url", origin + "/", "--json")
    assert (code, err) == (0, _note("info", gateway)) and json.loads(out)["url"] == f"{gateway}/{name}"
    code, out, err = await cli("cat", name, "--url", origin)
    assert (code, out, err) == (0, b"hi", _note("cat", gateway))
    # Writes too (at the root, create made a bucket of that name and said "created").
    code, out, err = await cli("create", f"{name}-new", "--url", origin, "--content-type", "text/plain")
    assert (code, err) == (0, _note("create", gateway))
    assert out.startswith(f"created {gateway}/{name}-new (text/plain, ".encode())
    code, out, err = await cli("append", name, "--url", origin, "!")
    assert (code, err) == (0, _note("append", gateway))
    code, out, err = await cli("fork", f"{name}-copy", "--from", name, "--url", origin, "--json")
    assert (code, err) == (0, _note("fork", gateway)) and json.loads(out)["url"] == f"{gateway}/{name}-copy"
    cli.monkeypatch.setenv("DURABLE_STREAMS_URL", origin)  # the variable, as --url
    code, out, err = await cli("close", name)
    assert (code, err) == (0, _note("close", gateway))
    assert out == f"closed {gateway}/{name} at {offsets.encode(3)}\n".encode()
    cli.monkeypatch.delenv("DURABLE_STREAMS_URL")
    code, out, err = await cli("tail", name, "--url", origin, "--offset", "-1")  # closed: to its end
    assert (code, out, err) == (0, b"hi!", _note("tail", gateway))
    # The prefix itself, or only full URLs: no check, no note.
    code, out, err = await cli("ls", name, "--url", gateway)
    assert (code, out, err) == (0, f"{name}\n{name}-copy\n{name}-new\n".encode(), "")
    code, out, err = await cli("cat", f"{gateway}/{name}", "--url", origin)
    assert (code, out, err) == (0, b"hi!", "")
    code, out, err = await cli("rm", f"{name}-copy", "--url", origin)
    assert (code, out, err) == (0, f"deleted {gateway}/{name}-copy\n".encode(), _note("rm", gateway))
    # Unreachable: exit 6 as before, naming the URL given.
    nowhere = f"http://127.0.0.1:{free_port()}"
    code, _, err = await cli("info", name, "--url", nowhere)
    assert code == 6 and "cannot reach" in err and err.rstrip().endswith(f"({nowhere})")


async def test_server_address_as_url_other_prefixes(cli: Cli, redis_url: str) -> None:
    name = _name()
    # A prefix of its own: GET / leads to the console under it.
    server = await start_gateway(redis_url, prefix="/streams")
    try:
        origin = _origin(str(server.make_url("/")))
        base = f"{origin}/streams"
        code, out, err = await cli("ls", "--url", origin)
        assert (code, err) == (0, _note("ls", base))
        code, out, err = await cli("create", name, "--url", origin, "--content-type", "text/plain", "x")
        assert (code, err) == (0, _note("create", base))
        assert out.startswith(f"created {base}/{name} ".encode())
        code, out, err = await cli("ls", name, "--url", base)
        assert (code, out, err) == (0, f"{name}\n".encode(), "")
    finally:
        await server.close()
    # ... with the console off: nothing says it, a usage error names the URL to give.
    server = await start_gateway(redis_url, prefix="/streams", console="off")
    try:
        origin = _origin(str(server.make_url("/")))
        refusal = (
            f"--url {origin} is the server's address, not the streams' base URL, and its stream prefix "
            f"is not /v1/stream: pass --url {origin}/PREFIX, PREFIX being the server's --prefix "
            "(DURABLE_STREAMS_PREFIX)\n"
        )
        for command in ("ls", "info", "cat"):
            code, out, err = await cli(command, *([name] if command != "ls" else []), "--url", origin)
            assert (code, out, err) == (2, b"", f"durable-streams {command}: {refusal}")
        code, out, err = await cli("info", name, "--url", f"{origin}/streams")
        assert (code, err) == (0, "") and b"content-type: text/plain" in out
    finally:
        await server.close()
    # The usual prefix with the console off: found by its listing.
    async with serving(redis_url, console="off") as base:
        code, out, err = await cli("ls", name, "--url", _origin(base))
        assert (code, out, err) == (0, f"{name}\n".encode(), _note("ls", base))
    # Streams at the root: the server's address is their base URL, used as it is.
    server = await start_gateway(redis_url, prefix="/")
    try:
        origin = _origin(str(server.make_url("/")))
        code, out, err = await cli("create", f"{name}-root", "--url", origin, "--content-type", "text/plain")
        assert (code, err) == (0, "") and out.startswith(f"created {origin}/{name}-root ".encode())
        code, out, err = await cli("ls", name, "--url", origin)
        assert (code, out, err) == (0, f"{name}\n{name}-root\n".encode(), "")
    finally:
        await server.close()


async def _tail(base: str, *args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_")}
    # SIGINT as a terminal gives it, whatever this process got: a suite started in the
    # background (`cmd &` without job control) ignores SIGINT, and so would tail, rightly.
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "tail", "--url", base, *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


async def test_tail_follows_until_closed(redis_url: str, http: aiohttp.ClientSession) -> None:
    # SSE responses end every second here: tail must reconnect from its last offset.
    async with serving(redis_url, sse_cycle_seconds=1.0) as base:
        name = _name()
        url = f"{base}/{name}"
        async with http.put(url, data=b"old ", headers={"Content-Type": "text/plain"}) as r:
            start = r.headers["Stream-Next-Offset"]
        proc = await _tail(base, name, "--offset", start)
        assert proc.stdout is not None
        try:
            await asyncio.sleep(0.5)
            await http.post(url, data=b"new ", headers={"Content-Type": "text/plain"})
            assert await asyncio.wait_for(proc.stdout.readexactly(4), 15) == b"new "
            await asyncio.sleep(1.5)  # past a cycle end
            await http.post(
                url, data=b"last", headers={"Content-Type": "text/plain", "Stream-Closed": "true"}
            )
            out, err = await asyncio.wait_for(proc.communicate(), 15)
            assert proc.returncode == 0, err
            assert out == b"last"
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

        interrupted = await _tail(base, name + "-open", "--offset", "-1")
        async with http.put(f"{url}-open", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 201
        await http.post(
            f"{url}-open", data=b'[{"a":1},{"b":2}]', headers={"Content-Type": "application/json"}
        )
        assert interrupted.stdout is not None
        try:
            line = await asyncio.wait_for(interrupted.stdout.readline(), 15)
            assert line == b'{"a":1}\n'
            interrupted.send_signal(signal.SIGINT)
            await asyncio.wait_for(interrupted.wait(), 10)
            assert interrupted.returncode == 130
        finally:
            if interrupted.returncode is None:
                interrupted.kill()
                await interrupted.wait()


async def test_doctor(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    code, out, err = await cli("doctor", "--redis-url", redis_url, "--archive-url", str(tmp_path))
    lines = out.decode().splitlines()
    assert code == 0, out.decode() + err
    assert [line.split()[1] for line in lines] == [
        "version:", "cluster:", "latency:", "persistence:", "eviction:", "layout:", "fleet:", "archive:",
    ]  # fmt: skip
    for check in ("cluster", "persistence", "eviction", "layout", "fleet", "archive"):
        assert any(line.startswith(f"ok    {check}:") for line in lines), lines
    code, out, _ = await cli(
        "doctor", "--redis-url", redis_url, "--redis-cluster", "--archive-url", str(tmp_path)
    )
    assert code == 1 and b"fail  cluster: --redis-cluster given" in out
    code, out, _ = await cli("doctor", "--redis-url", redis_url, "--archive-url", "nosuchfs://bucket/x")
    assert code == 1 and b"fail  archive:" in out


async def test_doctor_names_appendfsync(cli: Cli, own_redis: EmbeddedRedis, tmp_path: Path) -> None:
    client = aioredis.Redis.from_url(own_redis.url)
    try:
        await client.config_set("appendfsync", "everysec")
    finally:
        await client.aclose()
    code, out, _ = await cli("doctor", "--redis-url", own_redis.url, "--archive-url", str(tmp_path))
    (line,) = [line for line in out.decode().splitlines() if "persistence" in line]
    assert line.startswith("warn  persistence:") and "appendfsync" in line and "always" in line
    code, out, _ = await cli("doctor", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert code == 1 and out.startswith(b"fail  redis: cannot use")


async def test_tail_ends_when_cancelled_even_if_a_library_swallowed_the_cancellation(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C cancels tail's task. Were the cancellation swallowed on its way out of a
    response (the response then just ends, as at an SSE cycle), tail must not reconnect
    forever: it checks its task is being cancelled before each reconnect."""
    real_events = client_read._sse_events
    swallow = True

    async def swallowing(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
        try:
            async for event in real_events(response):
                yield event
        except asyncio.CancelledError:
            if swallow:
                return  # as if the server had ended the response
            raise

    monkeypatch.setattr(client_read, "_sse_events", swallowing)
    async with serving(redis_url, sse_cycle_seconds=30.0) as base:
        name = _name()
        async with aiohttp.ClientSession() as http:
            await (await http.put(f"{base}/{name}", headers={"Content-Type": "text/plain"})).release()
        args = build_parser().parse_args(["tail", "--url", base, name, "--offset", "now"])
        task = asyncio.create_task(client_read.tail(args))
        await asyncio.sleep(0.5)  # following the stream, its response open
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        swallow = False  # (so that a tail still running can be stopped: the test fails, not hangs)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=5)
        assert done, "tail went on after its task was cancelled"
        assert task.cancelled()


async def test_tenants(cli: Cli, redis_url: str) -> None:
    """``durable-streams tenants``: quotas changed and shown through the tenants API."""
    tenant = f"cli{uuid.uuid4().hex[:8]}"
    async with serving(redis_url, tenants=True, tenant_paths=f"{tenant}/={tenant}") as base:
        code, out, err = await cli("tenants", tenant, "--url", base, "--set", "streams=3", "--json")
        assert code == 0, err
        assert json.loads(out)["quotas"]["streams"] == 3
        code, out, _ = await cli(
            "create", f"{tenant}/s", "--url", base, "--content-type", "text/plain", "abc"
        )
        assert code == 0
        code, out, _ = await cli("tenants", "--url", base)
        line = next(x for x in out.decode().splitlines() if x.startswith(tenant))
        assert "streams 1/3" in line and "stored 3/-" in line
        code, out, _ = await cli("tenants", tenant, "--url", base, "--set", "streams=none")
        assert code == 0 and "streams 1/-" in out.decode()
        code, _, err = await cli("tenants", tenant, "--url", base, "--set", "streams=lots")
        assert code == 2 and "not a whole number" in err
        code, _, err = await cli("tenants", tenant, "--url", base, "--set", "nope=1")
        assert code != 0 and "unknown quota 'nope'" in err
        code, out, _ = await cli("tenants", "_defaults", "--url", base)
        assert code == 0 and json.loads(out)["tenant"] == "_defaults"


async def test_a_tenants_usage_from_the_command_line(cli: Cli, redis_url: str) -> None:
    tenant = f"cli{uuid.uuid4().hex[:8]}"
    async with serving(redis_url, tenants=True, tenant_paths=f"{tenant}/={tenant}") as base:
        code, _, _ = await cli("create", f"{tenant}/u", "--url", base, "--content-type", "text/plain", "abcd")
        assert code == 0
        code, out, err = await cli("tenants", tenant, "--url", base, "--usage")
        assert code == 0, err
        assert "bytes_in=4" in out.decode() and "streams_created=1" in out.decode()
        code, _, err = await cli("tenants", "--url", base, "--usage")
        assert code == 2 and "need a TENANT" in err
