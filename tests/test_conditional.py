"""Conditional writes: If-Match (POST and PUT) and Stream-Expected-Offset (POST).

The rules alone (parsing, the ETag they compare), then over HTTP against real Redis:
412/409 with the stream's current Stream-Next-Offset and ETag, the order of the
checks (closure, producers' duplicates, Stream-Seq), JSON and closed streams, PUT,
racers of which exactly one wins (one gateway, two gateways, a Redis Cluster), and
appends of one batch each checked against the stream as the earlier ones left it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.archive.cold import ColdReader
from gateway.archive.files import Archive
from gateway.protocol import caching, offsets
from gateway.protocol.conditions import Expected, IfMatch, parse_expected_offset, parse_if_match
from gateway.protocol.errors import ProtocolError
from gateway.protocol.models import AppendResult, CreateSpec
from gateway.redis_io import keys
from gateway.redis_io.scripts import Scripts
from gateway.streams.store import Store

from .cluster import Cluster
from .conftest import read_all, serving
from .test_live import evalsha_calls

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}


# -- the rules ----------------------------------------------------------------


class TestRules:
    def test_our_etags_name_an_incarnation_a_tail_and_closure(self) -> None:
        tag = caching.stream_etag("s", "1700000000123", 42, False)
        named = caching.named_state(tag.strip('"'), "s")
        assert named == caching.Named(created="1700000000123", end=42, closed=False)
        closed = caching.stream_etag("s", "1700000000123", 42, True)
        assert closed != tag and caching.named_state(closed.strip('"'), "s") == caching.Named(
            "1700000000123", 42, True
        )
        assert caching.named_state(tag.strip('"'), "other") is None  # another stream's tag
        forged = tag.strip('"').replace("1700000000123", "1700000000124")
        assert caching.named_state(forged, "s") is None  # the check binds created to the stream
        read = caching.etag("s", "1700000000123", 10, 42, False)  # a read's ETag: its end counts
        assert caching.named_state(read.strip('"'), "s") == caching.Named("1700000000123", 42, False)

    def test_if_match_forms(self) -> None:
        tag = caching.stream_etag("s", "7", 5, False)
        offset = offsets.encode(5)
        assert parse_if_match(None, "s") is None
        assert parse_if_match([" * "], "s") == IfMatch(any=True)
        assert parse_if_match([tag], "s") == IfMatch((Expected(5, "7", False),))
        assert parse_if_match([offset], "s") == IfMatch((Expected(5),))  # bare, as upstream's OCC
        assert parse_if_match([f'"{offset}"'], "s") == IfMatch((Expected(5),))  # quoted
        # A list (and several header lines): weak and foreign tags can never match (dropped).
        foreign = caching.stream_etag("other", "7", 5, False)
        parsed = parse_if_match([f'W/{tag}, "nope", {foreign}', f' ,{offset} , "x,y"'], "s")
        assert parsed == IfMatch((Expected(5),))
        assert parse_if_match(['"nope"', f"W/{tag}"], "s") == IfMatch(())

    def test_if_match_matches_strongly(self) -> None:
        condition = parse_if_match([caching.stream_etag("s", "7", 5, False)], "s")
        assert condition is not None
        assert condition.matches("7", 5, False)
        assert not condition.matches("7", 6, False)  # moved
        assert not condition.matches("8", 5, False)  # re-created
        assert not condition.matches("7", 5, True)  # closed since
        by_offset = parse_if_match([offsets.encode(5)], "s")
        assert (
            by_offset is not None and by_offset.matches("8", 5, True) and not by_offset.matches("7", 4, False)
        )
        assert IfMatch(any=True).matches("1", 0, False)
        assert not IfMatch(()).matches("1", 0, False)

    def test_script_arg(self) -> None:
        assert IfMatch(any=True).script_arg() == "*"
        assert IfMatch(()).script_arg() == "!"
        assert IfMatch((Expected(5, "7", True), Expected(9))).script_arg() == "7:5:1 :9:"

    @pytest.mark.parametrize(
        "value",
        ["", " , ,", "abc", '"unterminated', '"a" "b"', '*, "a"', "W/abc", offsets.encode(5) + "x", '"a"b',
         "0000000000000002_0000000000000005"],
    )  # fmt: skip
    def test_malformed_if_match_is_400(self, value: str) -> None:
        with pytest.raises(ProtocolError) as caught:
            parse_if_match([value], "s")
        assert caught.value.status == 400

    def test_expected_offset(self) -> None:
        assert parse_expected_offset(None) is None
        assert parse_expected_offset(f" {offsets.encode(12)} ") == 12
        for bad in ("", "-1", "now", "12", "0000000000000000_00000000000000012", '"x"'):
            with pytest.raises(ProtocolError) as caught:
                parse_expected_offset(bad)
            assert caught.value.status == 400, bad


# -- over HTTP ----------------------------------------------------------------


async def post(
    http: aiohttp.ClientSession, url: str, data: bytes | str, **headers: str
) -> aiohttp.ClientResponse:
    """A POST (text/plain unless given), read whole; header names with _ for -."""
    sent = {**TEXT, **{k.replace("_", "-"): v for k, v in headers.items()}}
    async with http.post(url, data=data, headers=sent) as r:
        await r.read()
        return r


async def head(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    async with http.head(url) as r:
        return r


async def test_if_match_with_the_etag_of_head(http: aiohttp.ClientSession, url: str) -> None:
    async with http.put(url, data=b"ab", headers=TEXT) as r:
        assert r.status == 201
        created_etag = r.headers["ETag"]
    seen = await head(http, url)
    assert seen.headers["ETag"] == created_etag  # PUT and HEAD name the same state
    r = await post(http, url, "cd", If_Match=seen.headers["ETag"])
    assert r.status == 204 and r.headers["Stream-Next-Offset"] == offsets.encode(4)
    stale = await post(http, url, "XX", If_Match=seen.headers["ETag"])  # someone wrote since
    assert stale.status == 412
    now = await head(http, url)
    assert stale.headers["Stream-Next-Offset"] == now.headers["Stream-Next-Offset"] == offsets.encode(4)
    assert stale.headers["ETag"] == now.headers["ETag"] != seen.headers["ETag"]
    retry = await post(http, url, "ef", If_Match=stale.headers["ETag"])  # no HEAD needed
    assert retry.status == 204
    assert retry.headers["ETag"] == (await head(http, url)).headers["ETag"]  # a success names its state
    chained = await post(http, url, "gh", If_Match=retry.headers["ETag"])
    assert chained.status == 204 and "ETag" in chained.headers
    assert "ETag" not in (await post(http, url, "ij")).headers  # unconditional appends: as before
    assert await read_all(http, url) == b"abcdefghij"  # nothing from the 412


async def test_if_match_with_offsets_star_and_read_etags(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b"x" * 100, headers=TEXT)  # the test gateway reads 64 bytes a chunk
    tail = (await head(http, url)).headers["Stream-Next-Offset"]
    assert (await post(http, url, "a", If_Match=tail)).status == 204  # bare offset
    tail = offsets.encode(101)
    assert (await post(http, url, "b", If_Match=f'"{tail}"')).status == 204  # quoted
    assert (await post(http, url, "c", If_Match=tail)).status == 412
    assert (await post(http, url, "d", If_Match="*")).status == 204
    assert (await post(http, url, "e", If_Match=f'"nope", W/"{tail}", {offsets.encode(103)}')).status == 204
    # A read's ETag matches when the read ended at the tail, whatever it started from.
    async with http.get(url, params={"offset": offsets.encode(0)}) as r:
        first_chunk = r.headers["ETag"]
        assert r.headers.get("Stream-Up-To-Date") is None
    async with http.get(url, params={"offset": offsets.encode(90)}) as r:
        last_chunk = r.headers["ETag"]
        assert r.headers["Stream-Up-To-Date"] == "true"
    assert (await post(http, url, "f", If_Match=first_chunk)).status == 412
    assert (await post(http, url, "g", If_Match=last_chunk)).status == 204
    assert (await read_all(http, url))[100:] == b"abdeg"


async def test_expected_offset(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b"ab", headers=TEXT)
    ok = await post(http, url, "cd", Stream_Expected_Offset=offsets.encode(2))
    assert ok.status == 204 and ok.headers["Stream-Next-Offset"] == offsets.encode(4)
    late = await post(http, url, "XX", Stream_Expected_Offset=offsets.encode(2))
    assert late.status == 409
    assert late.headers["Stream-Next-Offset"] == offsets.encode(4)
    assert late.headers["ETag"] == (await head(http, url)).headers["ETag"]
    assert "expected offset" in await late.text()
    assert (
        await post(http, url, "ef", Stream_Expected_Offset=late.headers["Stream-Next-Offset"])
    ).status == 204
    assert await read_all(http, url) == b"abcdef"


async def test_malformed_headers_are_400_and_store_nothing(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b"ab", headers=TEXT)
    for headers in (
        {"If-Match": "abc"},
        {"If-Match": ""},
        {"If-Match": '*, "x"'},
        {"Stream-Expected-Offset": "2"},
        {"Stream-Expected-Offset": "now"},
        {"Stream-Expected-Offset": "-1"},
    ):
        async with http.post(url, data=b"zz", headers={**TEXT, **headers}) as r:
            assert r.status == 400, headers
        async with http.put(url, headers={**TEXT, **headers}) as r:
            assert r.status == (400 if "If-Match" in headers else 200), headers  # PUT ignores the other
    assert await read_all(http, url) == b"ab"


async def test_missing_and_deleted_streams_answer_as_without_conditions(
    http: aiohttp.ClientSession, url: str
) -> None:
    # RFC 9110 13.2.1: a POST that would be 404 without the condition is 404 with it.
    assert (await post(http, url, "a", If_Match="*")).status == 404
    assert (await post(http, url, "a", Stream_Expected_Offset=offsets.encode(0))).status == 404
    await http.put(url, headers=TEXT)
    etag = (await head(http, url)).headers["ETag"]
    await http.delete(url)
    await asyncio.sleep(0.005)  # incarnations are told apart by their creation's millisecond
    await http.put(url, headers=TEXT)  # a new incarnation at the same tail
    assert (await head(http, url)).headers["ETag"] != etag
    assert (await post(http, url, "a", If_Match=etag)).status == 412
    assert (await post(http, url, "b", If_Match=offsets.encode(0))).status == 204  # an offset is tail only


async def test_closed_streams(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b"ab", headers=TEXT)
    open_etag = (await head(http, url)).headers["ETag"]
    # Closing is an append like others: conditional too.
    closing = await post(http, url, "", If_Match=open_etag, Stream_Closed="true")
    assert closing.status == 204 and closing.headers["Stream-Closed"] == "true"
    closed = await head(http, url)
    assert closed.headers["ETag"] != open_etag and closed.headers["ETag"].endswith(':c"')
    # Data to a closed stream is 409 "closed" whatever the condition says (the RFC's "would
    # not be 2xx without it"): the client learns the stream is closed, not to retry.
    for condition in ({"If_Match": open_etag}, {"If_Match": closed.headers["ETag"]},
                      {"Stream_Expected_Offset": offsets.encode(2)}):  # fmt: skip
        r = await post(http, url, "x", **condition)
        assert r.status == 409 and r.headers["Stream-Closed"] == "true", condition
    # Closing again is done already (2xx), even with a stale condition (RFC 9110 13.1.1).
    assert (await post(http, url, "", If_Match=open_etag, Stream_Closed="true")).status == 204
    assert await read_all(http, url) == b"ab"


async def test_json_streams(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b'[{"a":1}]', headers=JSON)
    state = await head(http, url)
    r = await post(
        http, url, '[{"b":2},{"c":3}]', If_Match=state.headers["ETag"], Content_Type="application/json"
    )
    assert r.status == 204
    tail = r.headers["Stream-Next-Offset"]
    lost = await post(http, url, '{"d":4}', If_Match=state.headers["ETag"], Content_Type="application/json")
    assert lost.status == 412 and lost.headers["Stream-Next-Offset"] == tail
    r = await post(http, url, '{"e":5}', Stream_Expected_Offset=tail, Content_Type="application/json")
    assert r.status == 204
    async with http.get(url, params={"offset": "-1"}) as got:
        assert await got.json() == [{"a": 1}, {"b": 2}, {"c": 3}, {"e": 5}]


def producer(seq: int, epoch: int = 0) -> dict[str, str]:
    return {"Producer_Id": "p", "Producer_Epoch": str(epoch), "Producer_Seq": str(seq)}


async def test_producer_duplicates_come_before_conditions(http: aiohttp.ClientSession, url: str) -> None:
    await http.put(url, data=b"ab", headers=TEXT)
    etag = (await head(http, url)).headers["ETag"]
    first = await post(
        http, url, "cd", If_Match=etag, Stream_Expected_Offset=offsets.encode(2), **producer(0)
    )
    assert first.status == 200
    # Its answer was lost (say, a 504): the retry is the same request. The tail has moved
    # (by this very append), yet it is the duplicate it is, not a 412 or a 409.
    again = await post(
        http, url, "cd", If_Match=etag, Stream_Expected_Offset=offsets.encode(2), **producer(0)
    )
    assert again.status == 204 and again.headers["Producer-Seq"] == "0"
    # A refused condition uses no sequence number: the same seq goes again, matching.
    stale = await post(http, url, "ef", If_Match=etag, **producer(1))
    assert stale.status == 412
    assert (await post(http, url, "ef", If_Match=stale.headers["ETag"], **producer(1))).status == 200
    # Producer errors come first: a stale epoch is fenced (403), a gap is a gap (409).
    await post(http, url, "gh", **producer(0, epoch=1))
    r = await post(http, url, "zz", If_Match=etag, **producer(5, epoch=0))
    assert r.status == 403
    r = await post(http, url, "zz", If_Match=etag, **producer(5, epoch=1))
    assert r.status == 409 and r.headers["Producer-Expected-Seq"] == "1"
    assert await read_all(http, url) == b"abcdefgh"


async def test_order_of_checks(http: aiohttp.ClientSession, url: str) -> None:
    """closed → content type → producer → If-Match (412) → Stream-Expected-Offset (409) → Stream-Seq (409)."""
    await http.put(url, data=b"ab", headers=TEXT)
    etag = (await head(http, url)).headers["ETag"]
    assert (await post(http, url, "c", Stream_Seq="5")).status == 204
    stale, wrong = '"0-00000000:0:0"', offsets.encode(0)
    assert (await post(http, url, "{}", If_Match=stale, Content_Type="application/json")).status == 409
    assert (
        await post(http, url, "x", If_Match=stale, Stream_Expected_Offset=wrong, Stream_Seq="1")
    ).status == 412
    r = await post(http, url, "x", If_Match=offsets.encode(3), Stream_Expected_Offset=wrong, Stream_Seq="1")
    assert r.status == 409 and "expected offset" in await r.text()
    r = await post(http, url, "x", If_Match=offsets.encode(3), Stream_Seq="1")
    assert r.status == 409 and "Stream-Seq" in await r.text()
    # A Stream-Seq conflict says where the stream is, too (as upstream's does).
    assert r.headers["Stream-Next-Offset"] == offsets.encode(3) and r.headers["ETag"] != etag
    assert await read_all(http, url) == b"abc"


async def test_put_with_if_match(http: aiohttp.ClientSession, url: str) -> None:
    # A missing stream matches nothing, "*" included: the PUT creates nothing.
    for value in ("*", '"x"', offsets.encode(0)):
        async with http.put(url, headers={**TEXT, "If-Match": value}) as r:
            assert r.status == 412, value
            assert "Stream-Next-Offset" not in r.headers
    assert (await head(http, url)).status == 404
    async with http.put(url, data=b"ab", headers=TEXT) as r:
        etag = r.headers["ETag"]
    for value in ("*", etag, offsets.encode(2)):  # exists and matches: the idempotent create's rules
        async with http.put(url, headers={**TEXT, "If-Match": value}) as r:
            assert r.status == 200 and r.headers["ETag"] == etag, value
        async with http.put(url, headers={"Content-Type": "application/json", "If-Match": value}) as r:
            assert r.status == 409, value  # configured otherwise
    await post(http, url, "cd")
    async with http.put(url, headers={**TEXT, "If-Match": etag}) as r:
        assert r.status == 412  # moved: 412 comes before a create's answer, even a 409
        assert r.headers["Stream-Next-Offset"] == offsets.encode(4)
        assert r.headers["ETag"] == (await head(http, url)).headers["ETag"]
    async with http.put(url, headers={"Content-Type": "application/json", "If-Match": etag}) as r:
        assert r.status == 412


async def race(http: aiohttp.ClientSession, targets: list[str], headers: dict[str, str], n: int) -> list[int]:
    """``n`` appends at once, spread over ``targets`` (gateways' URLs of one stream), all
    with the same condition; each writes its own record. Their statuses, in order."""
    sent = [post(http, targets[i % len(targets)], f"r{i};", **headers) for i in range(n)]
    return [r.status for r in await asyncio.gather(*sent)]


@pytest.mark.parametrize("condition", ["If_Match", "Stream_Expected_Offset"])
async def test_one_racer_wins(
    http: aiohttp.ClientSession, quiet_redis: tuple[str, aioredis.Redis], condition: str
) -> None:
    """Many appends with the same condition at once, on one gateway and across two: they
    batch (fewer script calls than appends), and exactly one of them is stored."""
    redis_url, redis = quiet_redis
    async with serving(redis_url) as one, serving(redis_url) as two:
        for targets in ([one], [one, two]):
            name = f"race-{uuid.uuid4().hex[:10]}"
            urls = [f"{base}/{name}" for base in targets]
            await http.put(urls[0], data=b"ab", headers=TEXT)
            state = await head(http, urls[0])
            value = state.headers["ETag" if condition == "If_Match" else "Stream-Next-Offset"]
            await asyncio.gather(*(head(http, urls[i % len(urls)]) for i in range(32)))  # connections open
            before = await evalsha_calls(redis)
            statuses = await race(http, urls, {condition: value}, 32)
            calls = await evalsha_calls(redis) - before
            print(f"{calls} script calls for 32 racers on {len(urls)} gateway(s)")
            assert calls < 32, "no batching: the race was not inside a batch"
            losing = 412 if condition == "If_Match" else 409
            assert sorted(statuses) == [204] + [losing] * 31, statuses
            body = await read_all(http, urls[-1])
            assert body.startswith(b"ab") and body[2:].decode() == f"r{statuses.index(204)};"


@pytest.fixture
async def store(quiet_redis: tuple[str, aioredis.Redis], tmp_path) -> AsyncIterator[Store]:
    scripts = Scripts(quiet_redis[1])
    yield Store(scripts, ColdReader(Archive(str(tmp_path)), 1 << 20), max_chunk_bytes=1000)
    await scripts.close_held()  # (the client is the fixture's)


async def test_each_append_of_a_batch_is_checked_as_the_earlier_ones_left_the_stream(
    store: Store, quiet_redis: tuple[str, aioredis.Redis]
) -> None:
    """Appends queued in order go to Redis in one call after the first: each one's
    condition sees what the earlier ones (of that call too) did."""
    sid = keys.stream_id(f"chain-{uuid.uuid4().hex[:10]}")
    created, meta = await store.create(sid, CreateSpec("text/plain"))
    assert created

    def append(data: bytes, **condition: Any) -> asyncio.Task[AppendResult]:
        plain: dict[str, Any] = {"close": False, "stream_seq": None, "producer": None}
        return asyncio.create_task(store.append(sid, "text/plain", [(len(data), data)], **plain, **condition))

    def at(tail: int) -> dict[str, Any]:
        return {"expected_offset": tail}

    def tagged(tail: int) -> dict[str, Any]:
        return {"if_match": parse_if_match([caching.stream_etag(sid, meta.created, tail, False)], sid)}

    warm = keys.stream_id(f"warm-{uuid.uuid4().hex[:10]}")  # append.lua loaded: no NOSCRIPT retry counted
    await store.create(warm, CreateSpec("text/plain"))
    await store.append(warm, "text/plain", [(1, b"w")], close=False, stream_seq=None, producer=None)
    redis = quiet_redis[1]
    before = await evalsha_calls(redis)
    tasks = [
        append(b"a", **at(0)),  # alone
        append(b"b", **at(1)),  # then these, in one call: each sees the ones before it
        append(b"c", **tagged(2)),
        append(b"d", **at(3)),
        append(b"X", **at(3)),  # d was first
        append(b"Y", **tagged(3)),
        append(b"e", **tagged(4)),
    ]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert await evalsha_calls(redis) - before == 2  # the first alone, the rest together
    assert [r.tail for r in results if isinstance(r, AppendResult)] == [1, 2, 3, 4, 5]
    refused = [(e.status, e.headers["Stream-Next-Offset"]) for e in results if isinstance(e, ProtocolError)]
    assert refused == [(409, offsets.encode(4)), (412, offsets.encode(4))]
    assert isinstance(results[4], ProtocolError) and isinstance(results[5], ProtocolError)  # X and Y
    chunk = await store.read(sid, 0)
    assert b"".join(data for _, data in chunk.entries) == b"abcde"


async def test_a_stream_created_anew_at_once_is_another_incarnation(
    store: Store, quiet_redis: tuple[str, aioredis.Redis]
) -> None:
    """'created' names the incarnation (ETags, If-Match, live readers): a DELETE and a PUT
    back to back land in one millisecond often enough (unix socket round trips), and a
    stream created anew so must not take the created, so the ETags, of the one before:
    each creation at a path takes a later one than the last (keys.stream_born)."""
    redis = quiet_redis[1]
    sid = keys.stream_id(f"reborn-{uuid.uuid4().hex[:10]}")
    seen: list[int] = []
    for _ in range(40):
        _, meta = await store.create(sid, CreateSpec("text/plain"))
        seen.append(int(meta.created))
        await store.delete(sid)
    assert seen == sorted(set(seen)), seen  # strictly increasing
    etags = {caching.stream_etag(sid, str(created), 0, False) for created in seen}
    assert len(etags) == len(seen)
    # The clock read earlier than the last created given here (stepped back): later all the same.
    ahead = int(await redis.get(keys.stream_born(sid))) + 3_600_000
    await redis.set(keys.stream_born(sid), ahead, px=2000)
    _, meta = await store.create(sid, CreateSpec("text/plain"))
    assert int(meta.created) == ahead + 1
    assert 0 < await redis.pttl(keys.stream_born(sid)) <= 2000  # remembered briefly: one key a creation


# -- Redis Cluster --------------------------------------------------------------


@pytest.fixture
def cluster(redis_cluster: Cluster) -> Iterator[Cluster]:
    yield redis_cluster
    redis_cluster.heal()


async def test_conditions_on_a_redis_cluster(http: aiohttp.ClientSession, cluster: Cluster) -> None:
    """Streams on every shard, raced through two gateways at once (one batch splits into a
    call per slot): on each stream exactly one racer per condition wins."""
    from .test_cluster import names_on_each_primary

    names = names_on_each_primary(cluster, prefix="cond")
    async with (
        serving(cluster.seed_url, redis_cluster=True) as one,
        serving(cluster.seed_url, redis_cluster=True) as two,
    ):
        for name in names:
            await http.put(f"{one}/{name}", data=b"ab", headers=TEXT)
        states = {name: await head(http, f"{one}/{name}") for name in names}
        races = [race(http, [f"{one}/{name}", f"{two}/{name}"], {"If_Match": states[name].headers["ETag"]},
                      12) for name in names]  # fmt: skip
        races += [race(http, [f"{two}/{name}", f"{one}/{name}"],
                       {"Stream_Expected_Offset": offsets.encode(2)}, 12) for name in names]  # fmt: skip
        outcomes = await asyncio.gather(*races)
        for name, by_tag, by_offset in zip(
            names, outcomes[: len(names)], outcomes[len(names) :], strict=True
        ):
            # Both kinds raced for the same tail: one racer of the two groups won.
            assert sorted(by_tag + by_offset).count(204) == 1, (name, by_tag, by_offset)
            assert set(by_tag) <= {204, 412} and set(by_offset) <= {204, 409}
            body = await read_all(http, f"{one}/{name}")
            assert body.startswith(b"ab") and body.count(b";") == 1
        # PUT with If-Match on a cluster, too.
        async with http.put(
            f"{two}/{names[0]}", headers={**TEXT, "If-Match": states[names[0]].headers["ETag"]}
        ) as r:
            assert r.status == 412
