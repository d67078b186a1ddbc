"""Concurrent appends to one stream share script calls, and nobody can tell but the clock."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import aiohttp

from gateway.concurrency.batching import Batcher
from gateway.features.hints import Hints
from gateway.protocol.headers import Producer
from gateway.redis_io import keys
from gateway.redis_io.lua import source
from gateway.redis_io.scripts import Scripts
from gateway.streams.appends import AppendRequest, Appends, expand_runs

from .test_live import evalsha_calls, read_sse


class _AnyTime(bytes):  # an entry's append time (ms), whatever it is
    def __eq__(self, other: object) -> bool:
        return isinstance(other, bytes) and other.isdigit()

    __hash__ = bytes.__hash__


ANY_TIME = _AnyTime()
# An empty text/plain stream's meta, as create.lua writes it (for scripts called directly)
PLAIN_META = {"ct": "text/plain", "ctn": "text/plain", "base": "0", "tail": "0", "created": "1"}


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


async def test_concurrent_appends_share_calls_and_keep_every_rule(http, quiet_gateway) -> None:
    url, redis = quiet_gateway
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
    from gateway.concurrency.singleflight import SingleFlight

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


async def test_a_shared_read_that_fails_after_its_waiters_left_is_not_reported_unretrieved() -> None:
    """Every waiter of a shared read gone (clients left), then the read fails (the stream
    was deleted): nothing for asyncio to log as "exception was never retrieved"."""
    import gc

    from gateway.concurrency.singleflight import SingleFlight

    flights: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()
    unretrieved: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    gc.collect()  # earlier tests' garbage is reported now, not as this test's
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))

    async def read() -> str:
        await gate.wait()
        raise LookupError("stream not found")

    try:
        waiter = asyncio.create_task(flights.run("k", read))
        await asyncio.sleep(0)
        waiter.cancel()  # the only client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        gate.set()
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        assert not unretrieved, unretrieved
    finally:
        loop.set_exception_handler(None)


async def test_appends_to_many_streams_go_in_one_call_each_checked_alone(http, quiet_gateway) -> None:
    """A batch spans streams: append.lua binds each stream's keys in turn. Every stream
    keeps its own rules, data, expiry and notices; wrong streams get their own answers."""
    url, redis = quiet_gateway
    names = [f"{url}-{n}" for n in range(24)]
    for name in names:
        async with http.put(name, headers=TEXT) as r:
            assert r.status == 201
    ttl, closed, json_stream, missing = f"{url}-ttl", f"{url}-closed", f"{url}-json", f"{url}-missing"
    async with http.put(ttl, headers={**TEXT, "Stream-TTL": "600"}) as r:
        assert r.status == 201
    async with http.put(closed, headers={**TEXT, "Stream-Closed": "true"}) as r:
        assert r.status == 201
    async with http.put(json_stream, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 201
    watched = await http.get(names[3], params={"offset": "now", "live": "sse"})
    await read_sse(watched, "upToDate")
    before = await evalsha_calls(redis)

    async def post(target: str, body: bytes, headers: dict = TEXT) -> int:
        async with http.post(target, data=body, headers=headers) as r:
            await r.read()
            return r.status

    plain = [post(name, f"{name[-2:]}:{k};".encode()) for k in range(3) for name in names]
    odd = [
        post(ttl, b"lives"),
        post(closed, b"late"),
        post(missing, b"nobody"),
        post(json_stream, b"plain text", TEXT),
        post(json_stream, b'{"a": 1}', {"Content-Type": "application/json"}),
    ]
    statuses = await asyncio.gather(*plain, *odd)
    calls = await evalsha_calls(redis) - before
    assert statuses[: len(plain)] == [204] * len(plain)
    assert statuses[len(plain) :] == [204, 409, 404, 409, 204]
    assert calls < len(plain) // 4, f"{calls} script calls for {len(statuses)} appends to 28 streams"

    for name in names:  # each stream has exactly its own appends, in its writers' order
        body, offset = "", "-1"
        while True:
            async with http.get(name, params={"offset": offset}) as r:
                body += (await r.read()).decode()
                offset = r.headers["Stream-Next-Offset"]
                if r.headers.get("Stream-Up-To-Date") == "true":
                    break
        assert sorted(body.rstrip(";").split(";")) == [f"{name[-2:]}:{k}" for k in range(3)]

    # The TTL stream's new log got its deadline; the others got none.
    def log_key(target: str) -> str:
        return keys.stream_keys(keys.stream_id(target.rsplit("/", 1)[1]))[1]

    assert 0 < await redis.pttl(log_key(ttl)) <= 600_000
    assert await redis.pttl(log_key(names[0])) == -1
    # The reader of one stream was woken with that stream's data only.
    live = ""
    while live.count(";") < 3:
        for kind, data in await asyncio.wait_for(read_sse(watched, "streamNextOffset"), 5):
            if kind == "data":
                live += data
    assert sorted(live.rstrip(";").split(";")) == [f"{names[3][-2:]}:{k}" for k in range(3)]
    watched.close()


# The commit (stage_commit) of an append of exactly 4 bytes fails, after its entries went in: the 'partial'
# case append.lua reports (an error between an append's writes), injected for the test.
FAILING_COMMIT = """
do
  local real_stage = stage_commit
  stage_commit = function(m, staged, tail, ...)
    if tonumber(tail) - tonumber(m.tail) == 4 then error('injected after the entries') end
    return real_stage(m, staged, tail, ...)
  end
end
"""


async def test_an_append_whose_commit_failed_rides_no_notice(redis) -> None:
    """In one append.lua call, an append that failed after writing its entries ('partial')
    must not put its bytes in the notice the appends before it publish: live readers would
    take them for the stream's (the notice says where its bytes start and end)."""
    sid = keys.stream_id(f"partial-{uuid.uuid4().hex[:8]}")
    meta, _, _, _, channel = keys.stream_keys(sid)
    await redis.hset(meta, mapping=PLAIN_META)
    text = source("append")
    body = "local now = now_ms()\n"
    assert text.count(body) == 1
    script = redis.register_script(text.replace(body, FAILING_COMMIT + body))
    # (the failing one from a producer: written as it comes, not merged with the first: add_entries)
    requests = [
        AppendRequest("text/plain", False, "", None, [(2, b"ok")]),
        AppendRequest("text/plain", False, "", Producer("p", 0, 0), [(4, b"FAIL")]),
    ]
    appends = Appends(Scripts(redis), Hints(redis, enabled=False), 8192)
    script_keys, args, _ = appends._call([(sid, r, r.encoded_args()) for r in requests], [0, 1])
    pubsub = redis.pubsub()
    await pubsub.subscribe(channel)
    try:
        await pubsub.get_message(timeout=1.0)  # the subscription's confirmation
        replies = await script(script_keys, args)
        assert replies[0][0] == b"ok" and replies[1][:2] == [b"error", b"partial"], replies
        notice = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2.0)
        assert notice is not None
        head, _, data = notice["data"].partition(b"\n")
        assert head.startswith(b"0 2 0 ") and data == b"ok", notice["data"]
    finally:
        await pubsub.aclose()
        await redis.delete(*keys.stream_keys(sid)[:4])


async def test_a_stream_whose_write_fails_fails_alone_and_whole(redis) -> None:
    """Small appends to a stream in one call are stored together (one log entry: append.lua's
    merge); when that write fails (here: the log key is not a stream), every append of that
    stream in the call fails with nothing stored and its tail unmoved, and the other
    stream's appends in the same call are stored."""
    broken, fine = (keys.stream_id(f"{name}-{uuid.uuid4().hex[:8]}") for name in ("broken", "fine"))
    for sid in (broken, fine):
        await redis.hset(keys.stream_keys(sid)[0], mapping=PLAIN_META)
    await redis.set(keys.stream_keys(broken)[1], "not a stream")
    requests = [AppendRequest("text/plain", False, "", None, [(len(d), d)]) for d in (b"a", b"bb", b"ccc")]
    # ... and one refused against what the three left (tail 6, not 0): the state it was
    # refused against is not stored either, so it fails too, rather than name a tail that never was
    refused = AppendRequest("text/plain", False, "", None, [(1, b"d")], expected_offset="0")
    batch = [(broken, r, r.encoded_args()) for r in [*requests, refused]]
    batch += [(fine, r, r.encoded_args()) for r in requests]
    appends = Appends(Scripts(redis), Hints(redis, enabled=False), 8192)
    script_keys, args, _ = appends._call(batch, list(range(len(batch))))
    try:
        replies = await Scripts(redis).run("append", script_keys, args)
        # (fine's three plain appends are one result, a run: expand_runs)
        assert replies[4] == [b"ok", b"6", b"0", b"1", 3], replies
        replies = expand_runs(replies, [1, 2, 3, 1, 1, 2, 3])
        assert [r[:2] for r in replies[:4]] == [[b"error", b"none"]] * 4, replies
        assert [r[:2] for r in replies[4:]] == [[b"ok", 1], [b"ok", 3], [b"ok", 6]], replies
        assert await redis.hget(keys.stream_keys(broken)[0], "tail") == b"0"
        assert await redis.xrange(keys.stream_keys(fine)[1]) == [(b"0-1", {b"d": b"abbccc", b"t": ANY_TIME})]
    finally:
        await redis.delete(*keys.stream_keys(broken)[:4], *keys.stream_keys(fine)[:4])


async def test_a_failed_streams_appends_are_not_charged_to_their_tenant(redis) -> None:
    """The same failure for a tenant's call: the failed stream's appends, charged as they were
    checked, are taken back; the usage counts the stored stream's bytes alone."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    broken, fine = (keys.stream_id(f"{name}-{uuid.uuid4().hex[:8]}") for name in ("broken", "fine"))
    for sid in (broken, fine):
        await redis.hset(keys.stream_keys(sid)[0], mapping={**PLAIN_META, "tn": tenant})
    await redis.set(keys.stream_keys(broken)[1], "not a stream")
    requests = [
        AppendRequest("text/plain", False, "", None, [(len(d), d)], tenant=tenant) for d in (b"aaaa", b"bb")
    ]
    batch = [(sid, r, r.encoded_args()) for sid in (broken, fine) for r in requests]
    appends = Appends(Scripts(redis), Hints(redis, enabled=False), 8192)
    script_keys, args, _ = appends._call(batch, list(range(len(batch))))
    try:
        replies = expand_runs(await Scripts(redis).run("append", script_keys, args), [4, 2, 4, 2])
        assert [r[0] for r in replies] == [b"error", b"error", b"ok", b"ok"], replies
        assert await redis.hget(keys.tenant(tenant), "u.stored_bytes") == b"6"  # fine's 4 + 2
        assert await redis.hget(keys.tenant_streams(tenant), broken) is None
    finally:
        await redis.delete(*keys.stream_keys(broken)[:4], *keys.stream_keys(fine)[:4])
        await redis.delete(keys.tenant(tenant), keys.tenant_streams(tenant))


def test_a_run_of_plain_appends_expands_to_one_result_each() -> None:
    """append.lua answers a stream's plain appends one after another with one result (a run,
    its count last): each gets the tail after it less the next one's size, others pass as they are."""
    replies = [
        [b"ok", b"10", b"0", b"7", 3],  # sizes 2, 3, 5: tails 2, 5, 10
        [b"offset_conflict", b"10", b"7"],
        [b"ok", b"11", b"0", b"7"],  # a plain append alone
        [b"dup", b"11", b"0", b"0", b"4"],  # five fields, but not a run
        [b"ok", b"14", b"1", b"7"],
    ]
    assert expand_runs(replies, [2, 3, 5, 1, 1, 0, 3]) == [
        [b"ok", 2, b"0", b"7"],
        [b"ok", 5, b"0", b"7"],
        [b"ok", 10, b"0", b"7"],
        replies[1],
        replies[2],
        replies[3],
        replies[4],
    ]


async def test_a_streams_results_in_one_call_runs_and_all(redis) -> None:
    """What one call answers a stream's appends, mixed: plain ones in runs, broken by a
    refusal and by the closing append; every append still gets its own result once expanded."""
    sid = keys.stream_id(f"runs-{uuid.uuid4().hex[:8]}")
    await redis.hset(keys.stream_keys(sid)[0], mapping=PLAIN_META)

    def plain(data: bytes, expected_offset: str = "") -> AppendRequest:
        return AppendRequest(
            "text/plain", False, "", None, [(len(data), data)], expected_offset=expected_offset
        )

    requests = [
        plain(b"a"),
        plain(b"bb"),
        plain(b"x", expected_offset="0"),  # refused: the tail is 3 by then
        plain(b"ccc"),
        AppendRequest("text/plain", True, "", None, [(1, b"d")]),  # closes
        plain(b"e"),  # closed
    ]
    batch = [(sid, r, r.encoded_args()) for r in requests]
    appends = Appends(Scripts(redis), Hints(redis, enabled=False), 8192)
    script_keys, args, _ = appends._call(batch, list(range(len(batch))))
    try:
        replies = await Scripts(redis).run("append", script_keys, args)
        assert [r[0] for r in replies] == [b"ok", b"offset_conflict", b"ok", b"ok", b"closed"], replies
        assert replies[0][1:] == [b"3", b"0", b"1", 2], replies
        expanded = expand_runs(replies, [1, 2, 1, 3, 1, 1])
        assert [(r[0], int(r[1])) for r in expanded] == [
            (b"ok", 1),
            (b"ok", 3),
            (b"offset_conflict", 3),
            (b"ok", 6),
            (b"ok", 7),
            (b"closed", 7),
        ], expanded
        assert [r[2] for r in expanded if r[0] == b"ok"] == [b"0", b"0", b"0", b"1"]
        assert await redis.hget(keys.stream_keys(sid)[0], "tail") == b"7"
    finally:
        await redis.delete(*keys.stream_keys(sid)[:4])


async def test_a_stream_without_created_answers_each_append_alone(redis) -> None:
    """A stream whose meta has no 'created' (made before it was kept): its results have no
    fourth field, so no run's count can go fifth; each plain append is answered alone."""
    sid = keys.stream_id(f"nocreated-{uuid.uuid4().hex[:8]}")
    await redis.hset(
        keys.stream_keys(sid)[0], mapping={k: v for k, v in PLAIN_META.items() if k != "created"}
    )
    requests = [AppendRequest("text/plain", False, "", None, [(len(d), d)]) for d in (b"a", b"bb")]
    batch = [(sid, r, r.encoded_args()) for r in requests]
    appends = Appends(Scripts(redis), Hints(redis, enabled=False), 8192)
    script_keys, args, _ = appends._call(batch, list(range(len(batch))))
    try:
        assert await Scripts(redis).run("append", script_keys, args) == [
            [b"ok", b"1", b"0"],
            [b"ok", b"3", b"0"],
        ]
    finally:
        await redis.delete(*keys.stream_keys(sid)[:4])
