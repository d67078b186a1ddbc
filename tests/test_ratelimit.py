"""Rate limits: the rules (pure) and the token buckets shared through a real Redis."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from gateway.features.ratelimit import RateLimiter
from gateway.protocol.quotas import RateRule, match, parse_rules
from gateway.redis_io import keys
from gateway.redis_io.scripts import Scripts

from .conftest import free_port, wait_ready


def rule(spec: str) -> RateRule:
    (only,) = parse_rules(spec)
    return only


class TestParse:
    def test_example_spec(self) -> None:
        write, read, anon = parse_rules("write:=100/s+200 read:chat/=50/s anonymous:read:=10/s")
        assert write == RateRule("write", "", 100.0, 200.0, False, "write:")
        assert read == RateRule("read", "chat/", 50.0, 50.0, False, "read:chat/")
        assert anon == RateRule("read", "", 10.0, 10.0, True, "anonymous:read:")

    def test_separators_units_and_default_burst(self) -> None:
        rules = parse_rules(" read:a/=60/m ,write:b/=7200/hour;;admin:=0.5/s\n\tread:c=3/min+1 ")
        assert [(r.scope, r.prefix, r.per_second, r.burst) for r in rules] == [
            ("read", "a/", 1.0, 60.0),
            ("write", "b/", 2.0, 7200.0),
            ("admin", "", 0.5, 1.0),  # burst at least 1
            ("read", "c", 0.05, 1.0),
        ]

    def test_empty_spec_is_no_rules(self) -> None:
        assert parse_rules("") == ()
        assert parse_rules(" ,; ") == ()

    def test_prefixes_spelled_as_grants(self) -> None:
        assert rule("read:/chat/=1/s").prefix == "chat/"
        assert rule("read:*=1/s").prefix == ""
        assert rule("read:/=1/s").prefix == ""
        assert rule("read:a=b/=1/s").prefix == "a=b/"  # the rate follows the last '='
        assert rule("read:a:b/=1/s").prefix == "a:b/"

    def test_key_names_what_is_limited_not_how_much(self) -> None:
        assert rule("read:chat/=1/s").key == rule("read:/chat/=9/m+40").key
        keys_ = {r.key for r in parse_rules("read:x=1/s write:x=1/s anonymous:read:x=1/s read:y=1/s")}
        assert len(keys_) == 4

    @pytest.mark.parametrize(
        ("spec", "message"),
        [
            ("read", "scope must be read, write or admin"),
            ("delete:=1/s", "scope must be read, write or admin"),
            ("anonymous:=1/s", "scope must be read, write or admin"),
            ("READ:=1/s", "scope must be read, write or admin"),
            ("read:chat/", "'=' and a rate are missing"),
            ("read:=", "is not <count>/<unit>"),
            ("read:=10", "is not <count>/<unit>"),
            ("read:=ten/s", "is not <count>/<unit>"),
            ("read:=-1/s", "is not <count>/<unit>"),
            ("read:=1e3/s", "is not <count>/<unit>"),
            ("read:=1/s+", "is not <count>/<unit>"),
            ("read:=10/d", "unknown unit 'd'"),
            ("read:=0/s", "count must be above 0"),
            ("read:=1/s+0", "burst must be at least 1"),
            ("read:=1/s+0.5", "burst must be at least 1"),
            ("read:=1/s+" + "9" * 400, "burst must be at least 1"),
            ("read:=" + "9" * 400 + "/s", "count must be above 0"),
        ],
    )
    def test_bad_rule_is_named(self, spec: str, message: str) -> None:
        with pytest.raises(ValueError) as err:
            parse_rules(f"write:=1/s {spec} admin:=1/s")
        assert f"rate limit {spec!r}" in str(err.value)
        assert message in str(err.value)
        assert "expected [anonymous:]<read|write|admin>:<prefix>=<count>/<s|m|h>[+<burst>]" in str(err.value)

    def test_two_rules_for_the_same_streams(self) -> None:
        with pytest.raises(ValueError, match=r"rate limit 'read:\*=2/s': 'read:=1/s' already limits"):
            parse_rules("read:=1/s read:*=2/s")
        parse_rules("read:=1/s anonymous:read:=2/s write:=1/s")  # different scopes or audiences


class TestMatch:
    RULES = parse_rules(
        "read:=100/s read:chat/=50/s read:chat/42/=20/s write:chat/=5/s "
        "anonymous:read:=10/s anonymous:read:public/=30/s anonymous:write:open/=1/s"
    )

    def key(self, scope: str, path: str, anonymous: bool) -> str | None:
        found = match(self.RULES, scope, path, anonymous)
        return found.key if found else None

    def test_longest_prefix_of_the_scope_wins(self) -> None:
        assert self.key("read", "chat/42/x", False) == "read:chat/42/"
        assert self.key("read", "chat/4", False) == "read:chat/"
        assert self.key("read", "chatter", False) == "read:"
        assert self.key("write", "chat/42/x", False) == "write:chat/"

    def test_no_rule_of_the_scope_is_no_limit(self) -> None:
        assert self.key("write", "other", False) is None
        assert self.key("admin", "chat/42", False) is None

    def test_rules_are_found_in_any_order(self) -> None:
        assert match(tuple(reversed(self.RULES)), "read", "chat/42/x", False) == match(
            self.RULES, "read", "chat/42/x", False
        )

    def test_anonymous_rules_take_precedence_for_anonymous_requests(self) -> None:
        assert self.key("read", "chat/42/x", True) == "anonymous:read:"
        assert self.key("read", "public/x", True) == "anonymous:read:public/"

    def test_anonymous_falls_back_to_everyones_rules_where_none_of_its_own_matches(self) -> None:
        assert self.key("write", "open/x", True) == "anonymous:write:open/"
        assert self.key("write", "chat/1", True) == "write:chat/"
        assert self.key("write", "other", True) is None
        only_general = parse_rules("read:chat/=5/s")
        assert match(only_general, "read", "chat/1", True) == only_general[0]

    def test_credentials_never_fall_under_anonymous_rules(self) -> None:
        assert self.key("read", "public/x", False) == "read:"
        assert self.key("write", "open/x", False) is None


class TestBucketKey:
    def test_shape_and_hash_tag(self) -> None:
        name = keys.rate_bucket("jwt:" + "x" * 5000 + "}{", "read:" + "p" * 5000)
        assert name.startswith("ds:rate:{") and len(name) < 64
        tag = name[name.index("{") + 1 : name.index("}")]
        assert len(tag) == 24
        assert not fnmatch.fnmatchcase(name, keys.META_PATTERN)

    def test_one_slot_per_identity_one_key_per_rule(self) -> None:
        a, b = keys.rate_bucket("token:ci", "read:"), keys.rate_bucket("token:ci", "write:")
        assert a != b and a.split("}")[0] == b.split("}")[0]
        assert keys.rate_bucket("ip:1.2.3.4", "read:") != a
        assert keys.rate_bucket("token:ci", "read:") == a  # stable


# -- token buckets in Redis ----------------------------------------------------


@pytest.fixture
async def limiter(redis: aioredis.Redis) -> RateLimiter:
    return RateLimiter(Scripts(redis))


@pytest.fixture
async def other_gateway(redis_url: str) -> AsyncIterator[RateLimiter]:
    """A second limiter on a connection of its own, as another gateway would have."""
    client = aioredis.Redis.from_url(redis_url)
    yield RateLimiter(Scripts(client))
    await client.aclose()


def who() -> str:
    return f"token:test-{uuid.uuid4().hex[:12]}"


async def test_burst_then_refused_with_retry_after(limiter: RateLimiter) -> None:
    r, client = rule("write:=20/s+5"), who()
    assert [await limiter.take(client, r) for _ in range(5)] == [0.0] * 5
    wait = await limiter.take(client, r)
    assert 0 < wait <= 0.05  # one token at 20/s
    assert 0 < await limiter.take(client, r, cost=3) <= 0.15
    # another client, another rule: buckets of their own
    assert await limiter.take(who(), r) == 0.0
    assert await limiter.take(client, rule("read:=20/s+5")) == 0.0


async def test_refill_over_time_up_to_the_burst(limiter: RateLimiter) -> None:
    r, client = rule("read:=20/s+2"), who()
    assert await limiter.take(client, r, cost=2) == 0.0
    wait = await limiter.take(client, r)
    assert wait > 0
    await asyncio.sleep(wait + 0.01)
    assert await limiter.take(client, r) == 0.0
    await asyncio.sleep(0.3)  # 6 tokens' worth of time, but the bucket holds 2
    assert [await limiter.take(client, r) for _ in range(2)] == [0.0, 0.0]
    assert await limiter.take(client, r) > 0


async def test_refusal_writes_nothing(limiter: RateLimiter, redis: aioredis.Redis) -> None:
    r, client = rule("read:=1/s+2"), who()
    await limiter.take(client, r, cost=2)
    key = keys.rate_bucket(client, r.key)
    before = await redis.hgetall(key)
    assert before and float(before[b"t"]) == 0
    assert await limiter.take(client, r) > 0.9
    assert await redis.hgetall(key) == before


async def test_two_gateways_share_one_bucket(limiter: RateLimiter, other_gateway: RateLimiter) -> None:
    assert limiter.redis is not other_gateway.redis
    r, client = rule("write:=1/s+3"), who()
    assert await limiter.take(client, r) == 0.0
    assert await other_gateway.take(client, r) == 0.0
    assert await limiter.take(client, r) == 0.0
    assert await other_gateway.take(client, r) > 0.5
    assert await limiter.take(client, r) > 0.5


async def test_bucket_on_redis_clock_and_expires_when_full(
    limiter: RateLimiter, redis: aioredis.Redis
) -> None:
    r, client = rule("write:=1/s+10"), who()
    await limiter.take(client, r, cost=3)
    key = keys.rate_bucket(client, r.key)
    assert 2000 < await redis.pttl(key) <= 3000  # 3 tokens to refill at 1/s
    seconds, micros = await redis.time()
    assert abs(int((await redis.hget(key, "ts")) or 0) - (seconds * 1000 + micros // 1000)) < 1000

    fast, idle = rule("read:=100/s+2"), who()
    await limiter.take(idle, fast)
    idle_key = keys.rate_bucket(idle, fast.key)
    assert 0 < await redis.pttl(idle_key) <= 10
    await asyncio.sleep(0.05)
    assert await redis.exists(idle_key) == 0
    assert await limiter.take(idle, fast, cost=2) == 0.0  # gone means full


async def test_cost_above_burst_takes_a_full_bucket(limiter: RateLimiter) -> None:
    r, client = rule("write:=20/s+3"), who()
    assert await limiter.take(client, r, cost=10**12) == 0.0  # full: allowed, emptied
    assert 0 < await limiter.take(client, r) <= 0.05
    await asyncio.sleep(0.06)
    wait = await limiter.take(client, r, cost=10)  # refused until full again, not forever
    assert 0.05 < wait <= 0.15
    await asyncio.sleep(wait + 0.01)
    assert await limiter.take(client, r, cost=10) == 0.0


async def test_zero_and_negative_cost(limiter: RateLimiter, redis: aioredis.Redis) -> None:
    r, client = rule("write:=1/s+1"), who()
    assert await limiter.take(client, r, cost=0) == 0.0
    assert await redis.exists(keys.rate_bucket(client, r.key)) == 0  # a probe writes nothing
    with pytest.raises(ValueError, match="negative"):
        await limiter.take(client, r, cost=-5)
    assert await limiter.take(client, r) == 0.0
    assert await limiter.take(client, r) > 0


async def test_script_refuses_a_rule_that_would_wedge(limiter: RateLimiter) -> None:
    for bad in (
        RateRule("read", "", 0.0, 5.0, False, "read:"),
        RateRule("read", "", 1.0, 0.0, False, "read:"),
    ):
        with pytest.raises(redis.exceptions.ResponseError, match="rate and burst must be positive"):
            await limiter.take(who(), bad)


async def test_redis_failure_propagates() -> None:
    client = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            await RateLimiter(Scripts(client)).take(who(), rule("read:=1/s"))
    finally:
        await client.aclose()


async def test_a_changed_rule_keeps_its_buckets_within_the_new_burst(limiter: RateLimiter) -> None:
    before, after, client = rule("write:=1/s+10"), rule("write:=1/s+2"), who()
    assert before.key == after.key
    assert await limiter.take(client, before) == 0.0  # 9 left, but the new bucket holds 2
    assert [await limiter.take(client, after) for _ in range(2)] == [0.0, 0.0]
    assert await limiter.take(client, after) > 0.5
    assert await limiter.take(client, before) > 0.5  # one bucket: drained for both


# -- across gateway processes ----------------------------------------------------------


async def test_limits_hold_across_two_gateway_processes(redis_url: str, tmp_path) -> None:
    """Two `durable-streams serve` processes on one Redis share a credential's bucket:
    together they let through no more than the burst plus the refill; the rest get
    429 with Retry-After and store nothing; another credential has its own bucket."""
    tokens = tmp_path / "tokens.json"
    entries = [{"name": n, "token": f"{n}-token-0123456789", "grants": "admin:"} for n in ("one", "two")]
    tokens.write_text(json.dumps({"tokens": entries}))
    procs, ports = [], []
    try:
        for _ in range(2):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--redis-url", redis_url,
                 "--auth-tokens-file", str(tokens), "--rate-limits", "write:=5/s+10", "--no-archive-hints"],
                stderr=subprocess.PIPE,
            )  # fmt: skip
            procs.append(proc)
            wait_ready(port, proc)
            ports.append(port)
        path = f"/v1/stream/rl-{uuid.uuid4().hex[:8]}"
        one = {"Authorization": "Bearer one-token-0123456789", "Content-Type": "text/plain"}
        two = {"Authorization": "Bearer two-token-0123456789", "Content-Type": "text/plain"}
        async with aiohttp.ClientSession() as http:
            async with http.put(f"http://127.0.0.1:{ports[0]}{path}", headers=two) as r:
                assert r.status == 201

            async def post(i: int) -> tuple[int, str | None]:
                url = f"http://127.0.0.1:{ports[i % 2]}{path}"
                async with http.post(url, data=b"x", headers=one) as r:
                    return r.status, r.headers.get("Retry-After")

            started = time.monotonic()
            answers = await asyncio.gather(*(post(i) for i in range(40)))
            elapsed = time.monotonic() - started
            ok = [i for i, (status, _) in enumerate(answers) if status == 204]
            refused = [(i, after) for i, (status, after) in enumerate(answers) if status == 429]
            assert len(ok) + len(refused) == 40, answers
            assert 10 <= len(ok) <= 10 + 5 * elapsed + 1, (len(ok), elapsed)
            assert {i % 2 for i, _ in refused} == {0, 1}  # both gateways refused: one bucket
            assert all(after is not None and int(after) >= 1 for _, after in refused)
            async with http.get(f"http://127.0.0.1:{ports[1]}{path}?offset=-1", headers=two) as r:
                assert await r.read() == b"x" * len(ok)  # refused appends stored nothing
            async with http.post(f"http://127.0.0.1:{ports[1]}{path}", data=b"y", headers=two) as r:
                assert r.status == 204  # "two" has a bucket of its own
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


async def test_concurrent_takes_share_round_trips_and_count_exactly(
    limiter: RateLimiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Takes that arrive together go to Redis together (a few calls, not one each), and a
    bucket taken from several times in one call still lets exactly its burst through."""
    calls = []
    original = limiter.scripts.call

    async def counting(name, keys_, args, *held):  # type: ignore[no-untyped-def]
        calls.append(len(keys_))
        return await original(name, keys_, args, *held)

    monkeypatch.setattr(limiter.scripts, "call", counting)
    r, client, other = rule("write:=0.001/s+10"), who(), who()
    waits = await asyncio.gather(*(limiter.take(client if i % 2 else other, r) for i in range(60)))
    assert sum(w == 0 for w in waits[1::2]) == 10 and sum(w == 0 for w in waits[0::2]) == 10
    assert all(w > 0 for w in waits[1::2][10:]) and all(w > 0 for w in waits[0::2][10:])
    assert sum(calls) == 60 and len(calls) <= 3, calls
