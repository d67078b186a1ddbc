"""Costs guarded (issue 46): the work an append asks of Redis, counted, never timed, against the
budgets committed in tests/cost_budgets.json. A change that adds Redis commands or script calls
per append fails here with the budget it broke named; one that removes some lowers the budget.

Counted on a Redis of the test's own (``INFO commandstats`` deltas, every command a script runs
included), through the gateway's own append path (``Store.append``: the batcher, the script's
arguments), so nothing else's work is counted."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
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

from .conftest import own_redis_server, serving, started_gateway

BUDGETS = Path(__file__).with_name("cost_budgets.json")
APPENDS = 20  # sequential appends a scenario counts (after a first, not counted: scripts loaded)
BODY = b"x" * 100
INFO_BYTES = 3 * len(b"*2\r\n$4\r\nINFO\r\n$12\r\ncommandstats\r\n")  # the counting's own (about)
KEPT_APPENDS = 2000  # appends over which the memory blocks they keep are counted
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


async def request_bytes(redis: aioredis.Redis) -> int:
    return int((await redis.info("stats"))["total_net_input_bytes"])


async def reply_bytes(redis: aioredis.Redis, work) -> int:
    """The bytes Redis sent while ``work`` ran (its replies: INFO stats' output count, less
    the one INFO reply that lands inside the window, sized by two readings in a row)."""

    async def sent() -> int:
        return int((await redis.info("stats"))["total_net_output_bytes"])

    first = await sent()
    second = await sent()
    await work()
    return await sent() - second - (second - first)


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
    """Sequential appends (one batch each): script calls and Redis commands per append, and
    the bytes Redis reads per append (its arguments: each one costs Redis and Lua a string)."""
    st, redis = store
    work = await SEQUENTIAL[scenario](st)
    sent = await request_bytes(redis)
    calls, other = await counted(redis, work)
    sent = await request_bytes(redis) - sent - INFO_BYTES
    check(
        scenario,
        {
            "script_calls_per_append": calls / APPENDS,
            "commands_per_append": other / APPENDS,
            "request_bytes_per_append": sent / APPENDS,
        },
    )


@pytest.mark.parametrize("scenario", ["1", "64", "producers"])
async def test_concurrent_appends_share_script_calls(store, scenario: str) -> None:
    """64 appends at once, to one stream, to 64, or to one from 64 idempotent producers: they
    go to Redis in a few script calls (the first alone, the rest batched behind it), whatever
    the timing; a stream's state is written once a call, not once an append (one HSET of its
    meta, one of its producers); its plain appends answered by one result (a run), so the
    bytes Redis sends back per append fall with the batch."""
    st, redis = store
    streams = 64 if scenario == "64" else 1
    sids = [await make(st, f"batch-{scenario}-{i}") for i in range(streams)]

    def options(i: int, seq: int) -> dict[str, object]:
        return plain(producer=Producer(f"p{i}", 0, seq)) if scenario == "producers" else plain()

    for i in range(64):  # each stream's, each producer's first
        await st.append(sids[i % streams], "text/plain", [(len(BODY), BODY)], **options(i, 0))

    def work(seq: int):
        async def appends() -> None:
            await asyncio.gather(
                *(
                    st.append(sids[i % streams], "text/plain", [(len(BODY), BODY)], **options(i, seq))
                    for i in range(64)
                )
            )

        return appends

    calls, other = await counted(redis, work(1))
    replied = await reply_bytes(redis, work(2))  # (a stream's plain appends: one result, a run)
    check(
        f"concurrent_{scenario}",
        {
            "script_calls_per_64": calls,
            "commands_per_append": other / 64,
            "reply_bytes_per_append": replied / 64,
        },
    )


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


def _request(
    client: socket.socket,
    port: int,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str] | None = None,
) -> None:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: text/plain\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
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


# -- Python work per append on the fast path ---------------------------------------------------


@pytest.mark.parametrize("producer", [False, True], ids=["plain", "producer"])
async def test_an_appends_python_work_stays_in_its_budget(quiet_redis, producer: bool) -> None:
    """Sequential appends on one keep-alive connection to an in-process gateway: the Python
    and C function calls its event loop makes per append (``sys.setprofile``: the client is a
    thread of its own, not profiled), and the memory blocks still allocated per append after
    them (``sys.getallocatedblocks``: what an append leaves behind, a cache or a leak)."""
    async with serving(quiet_redis[0]) as base:
        port = urlsplit(base).port
        with socket.create_connection(("127.0.0.1", port)) as client:
            headers = {"Producer-Id": "p", "Producer-Epoch": "0"} if producer else {}
            seqs = iter(range(10**6))

            def appends(count: int) -> None:
                for _ in range(count):
                    more = {**headers, "Producer-Seq": str(next(seqs))} if producer else {}
                    _request(client, port, "POST", "/v1/stream/python-costs", BODY, more)

            await asyncio.to_thread(_request, client, port, "PUT", "/v1/stream/python-costs", b"")
            await asyncio.to_thread(appends, 200)  # warm: scripts loaded, caches filled
            counts: Counter[str] = Counter()

            def profile(frame: object, event: str, arg: object) -> None:
                counts[event] += 1

            sys.setprofile(profile)
            try:
                await asyncio.to_thread(appends, APPENDS * 10)
            finally:
                sys.setprofile(None)
            # Many, so that what is kept a while and then let go (cancelled timers wait in the
            # event loop's heap until it cleans up: ~100) is not taken for a leak.
            gc.collect()
            blocks = sys.getallocatedblocks()
            await asyncio.to_thread(appends, KEPT_APPENDS)
            gc.collect()
            kept = sys.getallocatedblocks() - blocks
    check(
        "python_producer" if producer else "python",
        {
            "calls_per_append": (counts["call"] + counts["c_call"]) / (APPENDS * 10),
            "blocks_kept_per_append": kept / KEPT_APPENDS,
        },
    )
