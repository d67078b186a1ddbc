"""What one Redis core carries: Redis CPU per append, append.lua called directly.

    python -m loadtest.redis_cost [--seconds 5] [--rounds 3] [--batch 32] [--scenarios ...]

No gateway: batches as a gateway makes them (``Appends._call``, the same arguments, the
same script) go straight to an embedded redis-server (Unix socket, AOF fsync always, as
``durable-streams serve`` starts it), a few calls in flight, so that Redis, not the load
generator, is the busy process. Around each run the redis-server's CPU (user and system,
``/proc``) and ``INFO commandstats`` are read: what Redis spends per acknowledged append,
and so how many appends/s one Redis core (a Redis Cluster primary alike: the scripts are
the same) carries at that cost. ``loadtest.compare`` measures the same figure under HTTP
load (the ``+ N µs`` of its cells), where the batches are what the gateway's timing made.

Scenarios: ``one-stream`` (every append of a batch to one stream), ``1000-streams`` (each
append to the next of 1,000 streams, round-robin: a batch of 32 touches 32 streams),
``producers`` (one stream, each append from its own idempotent producer, seq + 1 each call).
Writes nothing; prints a table (one row per scenario: the median of the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis.asyncio as aioredis

from gateway.cli.embedded import EmbeddedRedis
from gateway.features.hints import Hints
from gateway.protocol.headers import Producer
from gateway.redis_io import keys
from gateway.redis_io.contracts import APPEND
from gateway.redis_io.scripts import Scripts
from gateway.streams.appends import AppendRequest, Appends, run_length

SCENARIOS = ("one-stream", "1000-streams", "producers")
BODY = b"x" * 100
IN_FLIGHT = 4  # calls in flight: Redis is never left waiting for the load generator


def redis_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


Batch = list[tuple[str, AppendRequest]]


def batch_maker(scenario: str, sids: list[str], size: int) -> Callable[[int, int], Batch]:
    """The appends of a lane's call number ``n`` of a scenario, each with its stream."""
    plain = AppendRequest("text/plain", False, "", None, [(len(BODY), BODY)])
    if scenario == "one-stream":
        fixed = [(sids[0], plain)] * size
        return lambda lane, n: fixed
    if scenario == "1000-streams":
        return lambda lane, n: [
            (sids[((n * IN_FLIGHT + lane) * size + k) % len(sids)], plain) for k in range(size)
        ]

    def producers(lane: int, n: int) -> Batch:  # a lane's producers: their seqs follow its calls
        return [
            (
                sids[0],
                AppendRequest("text/plain", False, "", Producer(f"l{lane}w{k}", 0, n), [(len(BODY), BODY)]),
            )
            for k in range(size)
        ]

    return producers


async def make_streams(client: aioredis.Redis, count: int) -> list[str]:
    """``count`` empty text/plain streams, their meta written as create.lua leaves it."""
    sids = [keys.stream_id(f"cost-{k}") for k in range(count)]
    async with client.pipeline(transaction=False) as pipe:
        for sid in sids:
            meta = keys.stream_keys(sid)[0]
            pipe.hset(
                meta,
                mapping={"ct": "text/plain", "ctn": "text/plain", "base": "0", "tail": "0", "created": "1"},
            )
        await pipe.execute()
    return sids


async def rewritten(client: aioredis.Redis) -> None:
    """The AOF rewritten, the one asked for here or one already under way (the previous
    scenario's, or Redis' own at start) waited out."""
    with contextlib.suppress(aioredis.ResponseError):  # one already under way
        await client.bgrewriteaof()
    while True:
        info = await client.info("persistence")
        if not (info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]):
            return
        await asyncio.sleep(0.1)


async def run(
    server: EmbeddedRedis, scenario: str, seconds: float, size: int, perf: str | None = None
) -> dict[str, float]:
    client = aioredis.Redis.from_url(server.url)
    try:
        await client.flushall()
        await rewritten(client)  # (a small AOF: no rewrite lands inside the run)
        sids = await make_streams(client, 1000 if scenario == "1000-streams" else 1)
        appends = Appends(Scripts(client), Hints(client, enabled=False), 8192)
        make = batch_maker(scenario, sids, size)
        scripts = Scripts(client)
        done = 0

        async def lane(index: int) -> None:
            nonlocal done
            calls = 0
            while time.monotonic() < deadline:
                batch = make(index, calls)
                calls += 1
                queued = [(sid, r, r.encoded_args()) for sid, r in batch]
                script_keys, args, _ = appends._call(queued, list(range(len(queued))))
                replies = await scripts.run(APPEND.name, script_keys, args)
                done += sum(run_length(reply) for reply in replies if reply[0] in (b"ok", b"dup"))

        await client.config_resetstat()
        pid = server.process.pid
        user0, system0 = redis_cpu(pid)
        deadline = time.monotonic() + seconds
        recording = perf and subprocess.Popen(
            [
                "perf",
                "record",
                "-q",
                "--call-graph",
                "dwarf,16384",
                "-F",
                "499",
                "-p",
                str(pid),
                "-o",
                f"{perf}.{scenario}",
            ],
            stderr=subprocess.DEVNULL,
        )
        await asyncio.gather(*(lane(index) for index in range(IN_FLIGHT)))
        user1, system1 = redis_cpu(pid)
        if recording:
            recording.send_signal(signal.SIGINT)
            recording.wait()
        stats = await client.info("commandstats")
        evalsha = stats.get("cmdstat_evalsha", {}).get("usec", 0)
        commands = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_evalsha", "cmdstat_config"))
        return {
            "appends": done,
            "user_us": 1e6 * (user1 - user0) / done,
            "system_us": 1e6 * (system1 - system0) / done,
            "script_us": evalsha / done,
            "commands": commands / done,
        }
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="appends per call (64 writers: ~32)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--redis-server", help="the redis-server binary (default: as serve finds one)")
    parser.add_argument("--perf", help="record the redis-server with perf (call graphs) into this file")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        server = EmbeddedRedis(data, binary=options.redis_server)
        server.start()
        try:
            rows: dict[str, list[dict[str, float]]] = {}
            for _ in range(options.rounds):  # interleaved: a noisy machine's drift spreads over all
                for scenario in options.scenarios.split(","):
                    result = asyncio.run(run(server, scenario, options.seconds, options.batch, options.perf))
                    rows.setdefault(scenario, []).append(result)
        finally:
            server.stop()
    print(
        "| scenario | Redis µs/append (user + sys) | in append.lua | commands/append | a core's appends/s |"
    )
    print("|---|---|---|---|---|")
    for scenario, results in rows.items():
        total = statistics.median(r["user_us"] + r["system_us"] for r in results)
        user = statistics.median(r["user_us"] for r in results)
        system = statistics.median(r["system_us"] for r in results)
        script = statistics.median(r["script_us"] for r in results)
        commands = statistics.median(r["commands"] for r in results)
        print(
            f"| {scenario} | {total:.1f} ({user:.1f} + {system:.1f}) | {script:.1f} | {commands:.2f} "
            f"| {1e6 / total:,.0f} |"
        )


if __name__ == "__main__":
    main()
