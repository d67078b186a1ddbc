"""Costs guarded (issue 46): the work an append asks of Redis, counted, never timed, against the
budgets committed in tests/cost_budgets.json. A change that adds Redis commands or script calls
per append fails here with the budget it broke named; one that removes some lowers the budget.

Counted on a Redis of the test's own (``INFO commandstats`` deltas, every command a script runs
included), through the gateway's own append path (``Store.append``: the batcher, the script's
arguments), so nothing else's work is counted."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from gateway.archive.cold import ColdReader
from gateway.archive.files import Archive
from gateway.protocol.headers import Producer
from gateway.protocol.models import CreateSpec
from gateway.redis_io import keys
from gateway.redis_io.scripts import Scripts
from gateway.streams.store import Store

from .conftest import own_redis_server, started_gateway

BUDGETS = Path(__file__).with_name("cost_budgets.json")
APPENDS = 20  # sequential appends a scenario counts (after a first, not counted: scripts loaded)
BODY = b"x" * 100
JSON_BODY = [(13, b'{"k":"v0001"}\n{"k":"v0002"}')]  # two JSON messages, as the gateway sends them


@pytest.fixture
async def store(
    quiet_redis: tuple[str, aioredis.Redis], tmp_path: Path
) -> AsyncIterator[tuple[Store, aioredis.Redis]]:
    client = quiet_redis[1]
    scripts = Scripts(client)
    yield Store(scripts, ColdReader(Archive(str(tmp_path)), 1 << 20), max_chunk_bytes=1 << 20), client
    await scripts.close_held()  # (the client is the fixture's)


async def commands(redis: aioredis.Redis) -> Counter[str]:
    stats = await redis.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})


async def counted(redis: aioredis.Redis, work) -> tuple[int, int]:
    """(script calls, other commands) Redis ran for ``work``."""
    before = await commands(redis)
    await work()
    delta = await commands(redis) - before
    delta.pop("info", None)
    calls = delta.pop("evalsha", 0) + delta.pop("eval", 0)
    return calls, sum(delta.values())


def plain(**more: object) -> dict[str, object]:
    return {"close": False, "stream_seq": None, "producer": None, **more}


async def make(store: Store, name: str, content_type: str = "text/plain") -> str:
    sid = keys.stream_id(name)
    await store.create(sid, CreateSpec(content_type))
    return sid


async def one_stream(store: Store) -> object:
    sid = await make(store, "one")
    await store.append(sid, "text/plain", [(len(BODY), BODY)], **plain())

    async def work() -> None:
        for _ in range(APPENDS):
            await store.append(sid, "text/plain", [(len(BODY), BODY)], **plain())

    return work


async def producer(store: Store) -> object:
    sid = await make(store, "producer")
    await store.append(sid, "text/plain", [(len(BODY), BODY)], **plain(producer=Producer("p", 0, 0)))

    async def work() -> None:
        for seq in range(1, APPENDS + 1):
            await store.append(
                sid, "text/plain", [(len(BODY), BODY)], **plain(producer=Producer("p", 0, seq))
            )

    return work


async def json_stream(store: Store) -> object:
    sid = await make(store, "json", "application/json")
    await store.append(sid, "application/json", JSON_BODY, **plain())

    async def work() -> None:
        for _ in range(APPENDS):
            await store.append(sid, "application/json", JSON_BODY, **plain())

    return work


async def many_streams(store: Store) -> object:
    sids = [await make(store, f"many-{i}") for i in range(APPENDS)]
    for sid in sids:
        await store.append(sid, "text/plain", [(len(BODY), BODY)], **plain())

    async def work() -> None:
        for sid in sids:  # one append each, each stream's second
            await store.append(sid, "text/plain", [(len(BODY), BODY)], **plain())

    return work


SEQUENTIAL = {
    "one_stream": one_stream,
    "producer": producer,
    "json": json_stream,
    "many_streams": many_streams,
}


def budget(scenario: str) -> dict[str, float]:
    return json.loads(BUDGETS.read_text())[scenario]


def check(scenario: str, measured: dict[str, float]) -> None:
    allowed = budget(scenario)
    print(f"{scenario}: {measured} (budget {allowed})")
    for metric, value in measured.items():
        assert value <= allowed[metric], (
            f"cost budget {scenario}.{metric} exceeded: {value} > {allowed[metric]} "
            f"({BUDGETS.name}): a change added Redis work per append; remove it, or raise the "
            "budget saying why in docs/benchmarks.md"
        )


@pytest.mark.parametrize("scenario", sorted(SEQUENTIAL))
async def test_an_appends_redis_work_stays_in_its_budget(store, scenario: str) -> None:
    """Sequential appends (one batch each): script calls and Redis commands per append."""
    st, redis = store
    work = await SEQUENTIAL[scenario](st)
    calls, other = await counted(redis, work)
    check(scenario, {"script_calls_per_append": calls / APPENDS, "commands_per_append": other / APPENDS})


@pytest.mark.parametrize("streams", [1, 64])
async def test_concurrent_appends_share_script_calls(store, streams: int) -> None:
    """64 appends at once, to one stream or to 64: they go to Redis in a few script calls
    (the first alone, the rest batched behind it), whatever the timing."""
    st, redis = store
    sids = [await make(st, f"batch-{streams}-{i}") for i in range(streams)]
    for sid in sids:
        await st.append(sid, "text/plain", [(len(BODY), BODY)], **plain())

    async def work() -> None:
        await asyncio.gather(
            *(st.append(sids[i % streams], "text/plain", [(len(BODY), BODY)], **plain()) for i in range(64))
        )

    calls, other = await counted(redis, work)
    check(f"concurrent_{streams}", {"script_calls_per_64": calls, "commands_per_append": other / 64})


# -- syscalls on the append door ---------------------------------------------------------------

SYSCALLS = "read,write,readv,writev,recvfrom,sendto,recvmsg,sendmsg"
_LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<at>\d+\.\d+)\s+(?P<call>\w+)\((?P<fd>\d+)<(?P<path>.*?)>,")


def _strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    return subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _strace_works(), reason="needs strace, allowed to trace (ptrace)")
def test_an_appends_syscalls_stay_in_their_budget(tmp_path: Path) -> None:
    """Sequential appends on one keep-alive connection to a gateway process traced by strace
    (``-yy``: each socket's addresses): the reads and writes per append on the client's
    connection (the fast path: the request in one read, the answer in one write) and on
    Redis' (one round trip a call)."""
    with own_redis_server(tmp_path / "redis") as server:
        trace = tmp_path / "strace.log"
        wrapper = ["strace", "-f", "-qq", "-yy", "-ttt", "-e", f"trace={SYSCALLS}", "-o", str(trace)]
        proc, base = started_gateway(server.url, tmp_path / "gateway.log", wrapper=wrapper)
        port = urlsplit(base).port
        try:
            with socket.create_connection(("127.0.0.1", port)) as client:
                _request(client, port, "PUT", "/v1/stream/costs", b"")
                for _ in range(20):  # warm: scripts loaded, the stream's first appends
                    _request(client, port, "POST", "/v1/stream/costs", BODY)
                started = time.time()
                for _ in range(APPENDS * 10):
                    _request(client, port, "POST", "/v1/stream/costs", BODY)
                ended = time.time()
        finally:
            for child in _children(proc.pid):  # (strace ends with its tracee)
                os.kill(child, signal.SIGTERM)
            proc.wait(30)
    counts: Counter[str] = Counter()
    redis_port = f":{urlsplit(server.url).port}"
    for line in trace.read_text().splitlines():
        found = _LINE.match(line)
        if not found or not started <= float(found["at"]) <= ended or "TCP" not in found["path"]:
            continue
        side = (
            "client"
            if f":{port}" in found["path"].split("->")[0]
            else "redis"
            if redis_port in found["path"]
            else None
        )
        if side:
            counts[side] += 1
    appends = APPENDS * 10
    check(
        "syscalls",
        {
            "client_reads_writes_per_append": counts["client"] / appends,
            "redis_reads_writes_per_append": counts["redis"] / appends,
        },
    )


def _request(client: socket.socket, port: int, method: str, path: str, body: bytes) -> None:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: text/plain\r\n"
    client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += client.recv(65536)
    status = int(answer.split(b" ", 2)[1])
    assert status in (200, 201, 204), answer
    length = re.search(rb"(?i)content-length: (\d+)", answer)
    rest = int(length.group(1)) if length else 0
    while len(answer.split(b"\r\n\r\n", 1)[1]) < rest:
        answer += client.recv(65536)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found
