"""Concurrent appends to one stream share script calls, and nobody can tell but the clock."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from gateway.batching import Batcher

from .test_live import evalsha_calls, read_sse


async def test_batcher_groups_what_arrives_during_a_call() -> None:
    calls: list[list[int]] = []
    release = asyncio.Event()

    async def call(key: str, items: list[int]) -> list[int]:
        calls.append(items)
        if len(calls) == 1:
            await release.wait()  # the first call is slow: others queue behind it
        return [item * 10 for item in items]

    batcher: Batcher[int, int] = Batcher(call, max_items=3)
    tasks = [asyncio.create_task(batcher.submit("s", n)) for n in range(8)]
    await asyncio.sleep(0.01)
    assert calls == [[0]]  # the first went at once, alone
    release.set()
    assert await asyncio.gather(*tasks) == [n * 10 for n in range(8)]
    assert calls == [[0], [1, 2, 3], [4, 5, 6], [7]]  # arrival order, at most 3 a call
    assert await batcher.submit("s", 9) == 90 and calls[-1] == [9]  # idle again: straight through
    assert await batcher.submit("other", 1) == 10  # keys do not wait for each other


async def test_batcher_failures_reach_every_waiter() -> None:
    gate = asyncio.Event()

    async def call(key: str, items: list[int]) -> list[int]:
        if items == [0]:
            await gate.wait()
            return [0]
        raise ConnectionError("redis away")

    batcher: Batcher[int, int] = Batcher(call)
    first = asyncio.create_task(batcher.submit("s", 0))
    rest = [asyncio.create_task(batcher.submit("s", n)) for n in (1, 2)]
    await asyncio.sleep(0.01)
    gate.set()
    assert await first == 0
    for task in rest:
        try:
            await task
            raise AssertionError("no error")
        except ConnectionError:
            pass


TEXT = {"Content-Type": "text/plain"}


async def test_concurrent_appends_share_calls_and_keep_every_rule(http, url, redis) -> None:
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 201
    sse = await http.get(url, params={"offset": "now", "live": "sse"})
    await read_sse(sse, "upToDate")
    before = await evalsha_calls(redis)

    async def post(body: bytes, headers: dict) -> aiohttp.ClientResponse:
        async with http.post(url, data=body, headers=headers) as r:
            await r.read()
            return r

    # 64 at once: a producer's pipelined sequence, plain appends, and one wrong content type.
    producer = [post(f"p{n};".encode(), {**TEXT, "Producer-Id": "w", "Producer-Epoch": "0",
                                          "Producer-Seq": str(n)}) for n in range(32)]  # fmt: skip
    plain = [post(f"x{n};".encode(), TEXT) for n in range(31)]
    wrong = [post(b"[1]", {"Content-Type": "application/json"})]
    responses = await asyncio.gather(*producer, *plain, *wrong)
    calls = await evalsha_calls(redis) - before
    assert [r.status for r in responses[:32]] == [200] * 32  # every seq accepted, in order
    assert [r.status for r in responses[32:63]] == [204] * 31 and responses[63].status == 409
    print(f"{calls} script calls for 64 concurrent appends")
    assert calls < 64, f"{calls} script calls for 64 concurrent appends: no batching"

    stored, offset = "", "-1"
    while True:  # the test gateway answers in small chunks
        async with http.get(url, params={"offset": offset}) as r:
            stored += (await r.read()).decode()
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                break
    pieces = stored.rstrip(";").split(";")
    assert sorted(pieces) == sorted([f"p{n}" for n in range(32)] + [f"x{n}" for n in range(31)])
    assert [p for p in pieces if p.startswith("p")] == [f"p{n}" for n in range(32)]
    # The live reader got exactly the same bytes through the batched notices.
    live = ""
    while len(live) < len(stored):
        for kind, data in await asyncio.wait_for(read_sse(sse, "streamNextOffset"), 5):
            if kind == "data":
                live += data
    assert live == stored
    sse.close()
    # A retry of the whole sequence is recognised as duplicates, batched or not.
    retries = await asyncio.gather(*[post(f"p{n};".encode(), {**TEXT, "Producer-Id": "w",
                                                               "Producer-Epoch": "0", "Producer-Seq": str(n)})
                                     for n in range(32)])  # fmt: skip
    assert {r.status for r in retries} == {204}


async def test_shared_reads_never_go_back_in_time() -> None:
    """A read that started before a caller's moment is not handed to that caller
    (it could miss an append the caller already knows was acknowledged)."""
    from gateway.singleflight import SingleFlight

    flights: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()
    calls: list[str] = []

    async def read(label: str) -> str:
        calls.append(label)
        await gate.wait()
        return label

    before = time.monotonic()
    first = asyncio.create_task(flights.run("k", lambda: read("first"), since=before))
    await asyncio.sleep(0)
    same_moment = asyncio.create_task(flights.run("k", lambda: read("unused"), since=before))
    after = time.monotonic()  # e.g. a client saw an append acknowledged, then asked
    later = asyncio.create_task(flights.run("k", lambda: read("later"), since=after))
    await asyncio.sleep(0)
    also_later = asyncio.create_task(flights.run("k", lambda: read("unused"), since=after))
    gate.set()
    assert [await t for t in (first, same_moment, later, also_later)] == ["first", "first", "later", "later"]
    assert calls == ["first", "later"]
