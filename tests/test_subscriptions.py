"""Subscriptions end to end (protocol sections 6-7): the APIs on a real gateway, wakes
recorded by appends in Redis, delivered by a real `durable-streams deliver` process to
a loopback receiver (tests/webhooks.py), pull-wake through an ordinary wake stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.protocol import offsets
from gateway.protocol.subscriptions import BEFORE_FIRST
from gateway.redis_io import keys

from .conftest import serving
from .webhooks import LOOPBACK, Delivery, deliver_worker, eventually, finish, receiver, verified

JSON = {"Content-Type": "application/json"}
FAST = ("--deliver-poll-seconds", "0.05")


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def worker(redis_url: str) -> Iterator[subprocess.Popen[bytes]]:
    with deliver_worker(redis_url, *FAST) as proc:
        yield proc


@pytest.fixture
async def base(redis_url: str) -> AsyncIterator[str]:
    async with serving(redis_url, webhook_allow=LOOPBACK) as url:
        yield url


async def put_sub(
    http: aiohttp.ClientSession, base: str, sub: str, **config: Any
) -> tuple[int, dict[str, Any]]:
    async with http.put(f"{base}/__ds/subscriptions/{sub}", json=config) as response:
        return response.status, await response.json(content_type=None)


async def get_sub(http: aiohttp.ClientSession, base: str, sub: str) -> dict[str, Any]:
    async with http.get(f"{base}/__ds/subscriptions/{sub}") as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def create_stream(http: aiohttp.ClientSession, url: str, body: Any = None) -> None:
    data = None if body is None else json.dumps(body)
    async with http.put(url, data=data, headers=JSON) as response:
        assert response.status == 201, await response.text()


async def append(http: aiohttp.ClientSession, url: str, body: Any) -> str:
    async with http.post(url, data=json.dumps(body), headers=JSON) as response:
        assert response.status in (200, 204), await response.text()
        return response.headers["Stream-Next-Offset"]


async def post(http: aiohttp.ClientSession, url: str, body: Any, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.post(url, json=body, headers=headers) as response:
        text = await response.text()
        return response.status, json.loads(text) if text else None


# -- the APIs --------------------------------------------------------------------------


async def test_create_confirm_conflict_read_delete(http: aiohttp.ClientSession, base: str) -> None:
    sub = _uid("sub")
    config = {
        "type": "webhook",
        "pattern": "shape/*",
        "streams": ["x/b", "/x/a/"],
        "webhook": {"url": "https://93.184.215.14/h"},
    }
    status, created = await put_sub(http, base, sub, **config, description="d")
    assert status == 201, created
    assert created["id"] == created["subscription_id"] == sub
    assert created["type"] == "webhook" and created["pattern"] == "shape/*" and created["description"] == "d"
    assert (
        created["lease_ttl_ms"] == 30000 and created["status"] == "active" and created["wake_stream"] is None
    )
    assert created["created_at"].endswith("Z")
    assert [(s["path"], s["link_type"], s["acked_offset"]) for s in created["streams"]] == [
        ("x/a", "explicit", offsets.ZERO),
        ("x/b", "explicit", offsets.ZERO),
    ]
    signing = created["webhook"]["signing"]
    assert signing["alg"] == "ed25519" and signing["kid"].startswith("ds_")
    assert signing["jwks_url"] == f"{base}/__ds/jwks.json"
    assert "webhook_secret" not in created and "secret" not in json.dumps(created)
    # The same configuration (streams in another order, normalized) re-confirms; another conflicts.
    status, again = await put_sub(http, base, sub, **{**config, "streams": ["x/a", "x/b"]}, description="d")
    assert status == 200 and again["created_at"] == created["created_at"]
    status, conflict = await put_sub(http, base, sub, **config, description="other")
    assert status == 409 and conflict["error"]["code"] == "SUBSCRIPTION_ALREADY_EXISTS"
    assert (await get_sub(http, base, sub))["description"] == "d"
    async with http.delete(f"{base}/__ds/subscriptions/{sub}") as response:
        assert response.status == 204
    for method in ("GET", "DELETE"):
        async with http.request(method, f"{base}/__ds/subscriptions/{sub}") as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "SUBSCRIPTION_NOT_FOUND"


@pytest.mark.parametrize(
    ("config", "code"),
    [
        (
            {"type": "webhook", "pattern": "a/*", "webhook": {"url": "http://10.0.0.1/hook"}},
            "WEBHOOK_URL_REJECTED",
        ),
        (
            {"type": "webhook", "pattern": "a/*", "webhook": {"url": "https://169.254.169.254/"}},
            "WEBHOOK_URL_REJECTED",
        ),
        (
            {"type": "webhook", "pattern": "a/*", "webhook": {"url": "http://example.com/"}},
            "WEBHOOK_URL_REJECTED",
        ),
        (
            {"type": "webhook", "pattern": "a/*", "webhook": {"url": "https://no-such-host.invalid/"}},
            "WEBHOOK_URL_REJECTED",
        ),
        (
            {"type": "webhook", "webhook": {"url": "https://93.184.215.14/"}},
            "INVALID_REQUEST",
        ),  # no pattern/streams
        ({"type": "pull-wake", "pattern": "a/*"}, "INVALID_REQUEST"),  # no wake_stream
        (
            {
                "type": "webhook",
                "pattern": "a/*",
                "webhook": {"url": "https://93.184.215.14/"},
                "lease_ttl_ms": 10,
            },
            "INVALID_REQUEST",
        ),
        ({"type": "carrier-pigeon", "pattern": "a/*"}, "INVALID_REQUEST"),
        (
            {"type": "webhook", "pattern": "__ds/*", "webhook": {"url": "https://93.184.215.14/"}},
            "INVALID_REQUEST",
        ),
    ],
)
async def test_bad_subscriptions_are_refused_and_store_nothing(
    http: aiohttp.ClientSession, redis_url: str, config: dict[str, Any], code: str
) -> None:
    sub = _uid("bad")
    async with serving(redis_url) as base:  # no allow list: the strict SSRF rules
        status, body = await put_sub(http, base, sub, **config)
        assert status == 400 and body["error"]["code"] == code, body
        async with http.get(f"{base}/__ds/subscriptions/{sub}") as response:
            assert response.status == 404


async def test_loopback_webhooks_need_the_allow_list(http: aiohttp.ClientSession, redis_url: str) -> None:
    config = {"type": "webhook", "pattern": "a/*", "webhook": {"url": "http://127.0.0.1:9/hook"}}
    async with serving(redis_url) as base:
        status, body = await put_sub(http, base, _uid("lo"), **config)
        assert status == 400 and body["error"]["code"] == "WEBHOOK_URL_REJECTED"
    async with serving(redis_url, webhook_allow=LOOPBACK) as base:
        status, _ = await put_sub(http, base, _uid("lo"), **config)
        assert status == 201


async def test_reserved_paths_and_jwks(http: aiohttp.ClientSession, base: str) -> None:
    for method, path in (("PUT", "__ds/anything"), ("GET", "__ds/subscriptions"), ("POST", "__ds/x/y")):
        async with http.request(method, f"{base}/{path}", data=b"x") as response:
            assert response.status == 404, path
    async with http.get(f"{base}/__ds/jwks.json") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("application/jwk-set+json")
        assert response.headers["Cache-Control"] == "public, max-age=300"
        keys_ = (await response.json(content_type=None))["keys"]
    assert keys_ and all(k["kty"] == "OKP" and k["crv"] == "Ed25519" and k["alg"] == "EdDSA" for k in keys_)


async def test_membership_add_remove_keeps_glob_links(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    sub, prefix = _uid("m"), _uid("mem")
    await create_stream(http, f"{base}/{prefix}/g")
    status, _ = await put_sub(
        http, base, sub, type="webhook", pattern=f"{prefix}/*", streams=[f"{prefix}/e"],
        webhook={"url": "https://93.184.215.14/h"},
    )  # fmt: skip
    assert status == 201

    async def links() -> dict[str, str]:
        return {s["path"]: s["link_type"] for s in (await get_sub(http, base, sub))["streams"]}

    await eventually(lambda: _has(links, f"{prefix}/g"))  # the worker's backfill links it
    for path in (f"{prefix}/g", f"{prefix}/n"):
        assert await post(http, f"{base}/__ds/subscriptions/{sub}/streams", {"streams": [path]}) == (
            204,
            None,
        )
    assert await links() == {f"{prefix}/e": "explicit", f"{prefix}/g": "explicit", f"{prefix}/n": "explicit"}
    for path in (f"{prefix}/g", f"{prefix}/n", f"{prefix}/never"):
        async with http.delete(
            f"{base}/__ds/subscriptions/{sub}/streams/{path.replace('/', '%2F')}"
        ) as response:
            assert response.status == 204
    assert await links() == {f"{prefix}/e": "explicit", f"{prefix}/g": "glob"}  # the glob link stays
    async with http.post(
        f"{base}/__ds/subscriptions/{_uid('none')}/streams", json={"streams": ["a"]}
    ) as response:
        assert response.status == 404


async def _has(links: Any, path: str) -> bool:
    return path in await links()


# -- webhooks ----------------------------------------------------------------------------


async def test_webhook_signed_done_auto_acks_and_wakes_again(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    async with receiver(finish) as box:
        sub, prefix = _uid("w"), _uid("ev")
        status, created = await put_sub(
            http, base, sub, type="webhook", pattern=f"{prefix}/*", webhook={"url": box.url}
        )
        assert status == 201
        url = f"{base}/{prefix}/one"
        await create_stream(http, url, {"n": 0})
        first = (await box.wait_for(1))[0]
        assert await verified(http, created["webhook"]["signing"]["jwks_url"], first)
        body = first.body
        assert body["subscription_id"] == sub and body["wake_id"].startswith("w_")
        assert body["callback_url"] == f"{base}/__ds/subscriptions/{sub}/callback"
        (stream,) = body["streams"]
        assert stream["path"] == f"{prefix}/one" and stream["link_type"] == "glob"
        assert stream["acked_offset"] == BEFORE_FIRST and stream["has_pending"] is True

        async def acked() -> str:
            return (await get_sub(http, base, sub))["streams"][0]["acked_offset"]

        await eventually(lambda: _equals(acked, stream["tail_offset"]))
        tail = await append(http, url, {"n": 1})
        second = (await box.wait_for(2))[1].body
        assert second["generation"] > body["generation"] and second["wake_id"] != body["wake_id"]
        assert second["streams"][0]["acked_offset"] == stream["tail_offset"]
        assert second["streams"][0]["tail_offset"] == tail
        await eventually(lambda: _equals(acked, tail))
        await asyncio.sleep(0.5)
        assert len(box.for_sub(sub)) == 2  # nothing pending: no third wake


async def _equals(get: Any, value: Any) -> bool:
    return await get() == value


async def test_callback_acks_extends_and_fences(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    async with receiver() as box:  # 200 without done: the receiver calls back
        sub, prefix = _uid("cb"), _uid("cb")
        await put_sub(
            http,
            base,
            sub,
            type="webhook",
            pattern=f"{prefix}/*",
            webhook={"url": box.url},
            lease_ttl_ms=5000,
        )
        url = f"{base}/{prefix}/s"
        await create_stream(http, url, {"n": 0})
        body = (await box.wait_for(1))[0].body
        cb, token = body["callback_url"], body["callback_token"]
        tail = body["streams"][0]["tail_offset"]
        wake = {"wake_id": body["wake_id"], "generation": body["generation"]}
        path = f"{prefix}/s"
        # Refusals change nothing: no token, another subscription's token, bad offsets.
        assert (await post(http, cb, {**wake, "done": True}))[0] == 401
        other = cb.replace(sub, _uid("cb"))
        status, answer = await post(http, other, {**wake, "done": True}, token)
        assert status in (401, 404), answer
        beyond = offsets.encode(10**15)
        for acks in ([{"stream": path, "offset": beyond}], [{"stream": f"{prefix}/nope", "offset": tail}]):
            status, answer = await post(http, cb, {**wake, "acks": acks, "done": True}, token)
            assert (status, answer["error"]["code"]) == (409, "INVALID_OFFSET")
        # A heartbeat (acks, no done) keeps the wake; then done finishes it.
        assert await post(http, cb, {**wake, "acks": [{"stream": path, "offset": tail}]}, token) == (
            200,
            {"ok": True, "next_wake": False},
        )
        assert (await get_sub(http, base, sub))["streams"][0]["acked_offset"] == tail
        assert await post(http, cb, {**wake, "done": True}, token) == (200, {"ok": True, "next_wake": False})
        status, answer = await post(http, cb, {**wake, "done": True}, token)
        assert (status, answer["error"]["code"]) == (409, "FENCED")
        # A stale generation in the body, with the token of the current one, is fenced too.
        await append(http, url, {"n": 1})
        body2 = (await box.wait_for(2))[1].body
        status, answer = await post(
            http,
            cb,
            {"wake_id": body2["wake_id"], "generation": body["generation"], "done": True},
            body2["callback_token"],
        )
        assert (status, answer["error"]["code"]) == (409, "FENCED")


async def test_pending_work_after_done_wakes_at_once(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    async with receiver() as box:
        sub, prefix = _uid("nx"), _uid("nx")
        await put_sub(http, base, sub, type="webhook", pattern=f"{prefix}/*", webhook={"url": box.url})
        url = f"{base}/{prefix}/s"
        await create_stream(http, url, {"n": 0})
        body = (await box.wait_for(1))[0].body
        await append(http, url, {"n": 1})  # arrives while the wake is out
        await asyncio.sleep(0.3)
        assert len(box.for_sub(sub)) == 1  # one wake in flight at a time
        status, answer = await post(
            http,
            body["callback_url"],
            {"wake_id": body["wake_id"], "generation": body["generation"], "done": True,
             "acks": [{"stream": f"{prefix}/s", "offset": body["streams"][0]["tail_offset"]}]},
            body["callback_token"],
        )  # fmt: skip
        assert (status, answer) == (200, {"ok": True, "next_wake": True})
        again = (await box.wait_for(2))[1].body
        assert again["streams"][0]["acked_offset"] == body["streams"][0]["tail_offset"]


async def test_backfill_links_existing_streams_at_their_tail(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    prefix = _uid("bf")
    old = f"{base}/{prefix}/old"
    await create_stream(http, old, {"history": True})
    async with receiver(finish) as box:
        sub = _uid("bf")
        await put_sub(http, base, sub, type="webhook", pattern=f"{prefix}/**", webhook={"url": box.url})

        async def linked() -> list[dict[str, Any]]:
            return (await get_sub(http, base, sub))["streams"]

        (link,) = await eventually(linked)
        async with http.head(old) as response:
            assert link["acked_offset"] == response.headers["Stream-Next-Offset"]  # history is not replayed
        await asyncio.sleep(0.3)
        assert box.received == []
        tail = await append(http, old, {"new": True})
        (delivery,) = await box.wait_for(1)
        assert delivery.body["streams"][0]["tail_offset"] == tail


async def test_explicit_stream_created_later_and_recreated(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    async with receiver(finish) as box:
        sub, path = _uid("ex"), f"{_uid('ex')}/later"
        await put_sub(http, base, sub, type="webhook", streams=[path], webhook={"url": box.url})
        url = f"{base}/{path}"
        await create_stream(http, url, {"n": 0})
        first = (await box.wait_for(1))[0].body["streams"][0]
        assert first["link_type"] == "explicit"
        await eventually(lambda: _equals(lambda: _acked(http, base, sub), first["tail_offset"]))
        async with http.delete(url) as response:
            assert response.status == 204
        await create_stream(http, url, {"n": 0})  # the same path anew: offsets start over
        again = (await box.wait_for(2))[1].body["streams"][0]
        assert again["acked_offset"] == BEFORE_FIRST and again["tail_offset"] == first["tail_offset"]


async def _acked(http: aiohttp.ClientSession, base: str, sub: str) -> str:
    return (await get_sub(http, base, sub))["streams"][0]["acked_offset"]


async def test_failing_receiver_is_retried_with_status_failed(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    answers = iter([(503, {}, 0.0), (500, {}, 0.0)])

    def flaky(_: Delivery) -> tuple[int, Any, float]:
        return next(answers, (200, {"done": True}, 0.0))

    async with receiver(flaky) as box:
        sub, prefix = _uid("rt"), _uid("rt")
        await put_sub(http, base, sub, type="webhook", pattern=f"{prefix}/*", webhook={"url": box.url})
        await create_stream(http, f"{base}/{prefix}/s", {"n": 0})
        await box.wait_for(1)
        await eventually(lambda: _equals(lambda: _status(http, base, sub), "failed"), timeout=5)
        got = await box.wait_for(3, timeout=15)
        gaps = [b.at - a.at for a, b in zip(got, got[1:], strict=False)]
        assert 0.7 <= gaps[0] <= 1.5 and 1.5 <= gaps[1] <= 3.0, gaps  # 1 s, 2 s (±20%) + a poll
        await eventually(lambda: _equals(lambda: _status(http, base, sub), "active"))


@pytest.mark.parametrize("failure", ["500", "hang-up"])
async def test_appends_while_the_receiver_fails_keep_to_the_retry_schedule(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes], failure: str
) -> None:
    """A failing subscription is retried 1 s, then 2 s after (section 7.1's backoff), however
    many appends wake it meanwhile: 20 appends over a second bring no attempt forward. The
    receiver answers 500, or hangs up on every connection."""
    attempts: list[float] = []

    def failing(_: Delivery) -> tuple[int, Any, float]:
        attempts.append(time.monotonic())
        return 500, {}, 0.0

    def hang_up(writer: asyncio.StreamWriter) -> None:
        attempts.append(time.monotonic())
        writer.close()

    async with contextlib.AsyncExitStack() as stack:
        if failure == "500":
            target = (await stack.enter_async_context(receiver(failing))).url
        else:
            server = await asyncio.start_server(lambda _, w: hang_up(w), "127.0.0.1", 0)
            stack.push_async_callback(server.wait_closed)
            stack.callback(server.close)
            target = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
        sub, prefix = _uid("sched"), _uid("sched")
        await put_sub(http, base, sub, type="webhook", pattern=f"{prefix}/*", webhook={"url": target})
        url = f"{base}/{prefix}/s"
        await create_stream(http, url, {"n": 0})
        await eventually(lambda: _true(bool(attempts)))
        for n in range(20):
            await append(http, url, {"n": n + 1})
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.6 - (time.monotonic() - attempts[0]))
        times = [round(t - attempts[0], 2) for t in attempts]
        assert len(times) <= 3, times  # the first, ~1 s, ~3 s (±20%, a poll): at most three by 2.6 s
        assert all(b - a >= 0.7 for a, b in zip(times, times[1:], strict=False)), times
    await http.delete(f"{base}/__ds/subscriptions/{sub}")


async def _true(value: bool) -> bool:
    return value


async def _status(http: aiohttp.ClientSession, base: str, sub: str) -> str:
    return (await get_sub(http, base, sub))["status"]


async def test_streams_without_subscribers_record_nothing(
    http: aiohttp.ClientSession, base: str, redis: Any, worker: subprocess.Popen[bytes]
) -> None:
    url = f"{base}/{_uid('quiet')}"
    sid = keys.stream_id(url.rsplit("/v1/stream/", 1)[1])
    await create_stream(http, url, {"n": 0})  # recorded (a worker runs): matched against the patterns

    async def let_go() -> bool:
        return await redis.zscore(keys.SUBS_OUTBOX, sid) is None

    await eventually(let_go)
    for n in range(5):
        await append(http, url, {"n": n})
    assert not await redis.exists(keys.stream_subs(sid))
    assert await let_go()  # no links: appends record nothing


# -- pull-wake ---------------------------------------------------------------------------


async def test_pull_wake_claim_ack_release_and_lease_expiry(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    sub, prefix = _uid("pw"), _uid("pw")
    wake_url = f"{base}/{prefix}-wake"
    await create_stream(http, wake_url, [])
    status, _ = await put_sub(
        http,
        base,
        sub,
        type="pull-wake",
        pattern=f"{prefix}/*",
        wake_stream=f"{prefix}-wake",
        lease_ttl_ms=1000,
    )
    assert status == 201
    claim_url = f"{base}/__ds/subscriptions/{sub}/claim"
    assert (await post(http, claim_url, {"worker": "w1"}))[1]["error"]["code"] == "NO_PENDING_WORK"
    await create_stream(http, f"{base}/{prefix}/a", {"n": 0})

    async def events() -> list[dict[str, Any]]:
        async with http.get(wake_url) as response:
            return [e for e in await response.json() if e["subscription_id"] == sub]

    (event,) = await eventually(events)
    assert event["type"] == "wake" and event["stream"] == f"{prefix}/a"
    status, claimed = await post(http, claim_url, {"worker": "w1"})
    assert status == 200 and claimed["generation"] == event["generation"] and claimed["lease_ttl_ms"] == 1000
    assert [s["path"] for s in claimed["streams"]] == [f"{prefix}/a"]
    status, busy = await post(http, claim_url, {"worker": "w2"})
    assert status == 409 and busy["error"] == {
        **busy["error"],
        "code": "ALREADY_CLAIMED",
        "current_holder": "w1",
    }
    ack_url = f"{base}/__ds/subscriptions/{sub}/ack"
    wake = {"wake_id": claimed["wake_id"], "generation": claimed["generation"]}
    for _ in range(3):  # heartbeats past the 1 s lease keep it
        await asyncio.sleep(0.5)
        assert (await post(http, ack_url, wake, claimed["token"]))[0] == 200
    # Unacked, the lease runs out: the holder is fenced, a new wake event goes out.
    await asyncio.sleep(1.3)
    status, answer = await post(http, ack_url, {**wake, "done": True}, claimed["token"])
    assert (status, answer["error"]["code"]) == (409, "FENCED")
    await eventually(lambda: _count(events, 2))
    status, again = await post(http, claim_url, {"worker": "w2"})
    assert status == 200 and again["generation"] > claimed["generation"]
    tail = again["streams"][0]["tail_offset"]
    done = {"wake_id": again["wake_id"], "generation": again["generation"], "done": True}
    acks = [{"stream": f"{prefix}/a", "offset": tail}]
    assert await post(http, ack_url, {**done, "acks": acks}, again["token"]) == (
        200,
        {"ok": True, "next_wake": False},
    )
    # Release with work pending writes another wake event.
    await append(http, f"{base}/{prefix}/a", {"n": 1})
    status, third = await post(http, claim_url, {"worker": "w1"})
    assert status == 200
    seen = len(await events())
    release = f"{base}/__ds/subscriptions/{sub}/release"
    assert (
        await post(
            http, release, {"wake_id": third["wake_id"], "generation": third["generation"]}, third["token"]
        )
    )[0] == 204
    await eventually(lambda: _count(events, seen + 1))


async def _count(get: Any, n: int) -> bool:
    return len(await get()) >= n


# -- keys ------------------------------------------------------------------------------


async def test_key_rotation_publishes_first_then_signs(
    http: aiohttp.ClientSession, base: str, redis_url: str, tmp_path: Path
) -> None:
    async def kids() -> list[str]:
        async with http.get(f"{base}/__ds/jwks.json") as response:
            return [k["kid"] for k in (await response.json(content_type=None))["keys"]]

    before = await kids()
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "webhook-keys", "rotate", "--redis-url", redis_url,
         "--activate-after", "0", "--retire-after", "3600"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    new = out.stdout.split()[1].rstrip(":")
    gateway_cache_seconds = 30
    del gateway_cache_seconds  # gateways re-read keys every 30 s: a fresh gateway sees them now
    async with serving(redis_url) as fresh:
        async with http.get(f"{fresh}/__ds/jwks.json") as response:
            listed = [k["kid"] for k in (await response.json(content_type=None))["keys"]]
    assert new in listed and set(before) <= set(listed)  # old keys stay published


async def test_deleted_streams_leave_glob_links_keep_explicit(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    prefix, sub = _uid("del"), _uid("del")
    for name in ("g", "e"):
        await create_stream(http, f"{base}/{prefix}/{name}", {"n": 0})
    await put_sub(
        http, base, sub, type="webhook", pattern=f"{prefix}/*", streams=[f"{prefix}/e"],
        webhook={"url": "https://93.184.215.14/h"},
    )  # fmt: skip

    async def paths() -> set[str]:
        return {s["path"] for s in (await get_sub(http, base, sub))["streams"]}

    await eventually(lambda: _equals(paths, {f"{prefix}/g", f"{prefix}/e"}))
    for name in ("g", "e"):
        async with http.delete(f"{base}/{prefix}/{name}") as response:
            assert response.status == 204
    await eventually(lambda: _equals(paths, {f"{prefix}/e"}))


# -- regressions found in review ----------------------------------------------------------


async def test_pull_wake_whose_pending_stream_went_still_wakes_again(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    """A wake event out, its only stream deleted before any claim: the claim finds nothing
    pending and the wake ends, so later appends wake the subscription again."""
    sub, prefix = _uid("wedge"), _uid("wedge")
    await create_stream(http, f"{base}/{prefix}-wake", [])
    await put_sub(http, base, sub, type="pull-wake", pattern=f"{prefix}/*", wake_stream=f"{prefix}-wake")

    async def events() -> list[dict[str, Any]]:
        async with http.get(f"{base}/{prefix}-wake") as response:
            return [e for e in await response.json() if e["subscription_id"] == sub]

    await create_stream(http, f"{base}/{prefix}/a", {"n": 0})
    await eventually(lambda: _count(events, 1))
    async with http.delete(f"{base}/{prefix}/a") as response:
        assert response.status == 204
    await eventually(lambda: _equals(lambda: _paths(http, base, sub), set()))
    status, body = await post(http, f"{base}/__ds/subscriptions/{sub}/claim", {"worker": "w"})
    assert (status, body["error"]["code"]) == (409, "NO_PENDING_WORK")
    await create_stream(http, f"{base}/{prefix}/b", {"n": 1})
    (_, second) = await eventually(lambda: _at_least(events, 2))
    assert second["stream"] == f"{prefix}/b"


async def _paths(http: aiohttp.ClientSession, base: str, sub: str) -> set[str]:
    return {s["path"] for s in (await get_sub(http, base, sub))["streams"]}


async def _at_least(get: Any, n: int) -> Any:
    found = await get()
    return found if len(found) >= n else None


async def test_a_subscription_made_anew_gets_its_streams_again(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    """The streams' side still names the deleted subscription: the new one is linked anyway."""
    async with receiver(finish) as box:
        sub, prefix = _uid("again"), _uid("again")
        url = f"{base}/{prefix}/s"
        await create_stream(http, url, {"n": 0})
        config = {"type": "webhook", "pattern": f"{prefix}/*", "webhook": {"url": box.url}}
        await put_sub(http, base, sub, **config)
        await eventually(lambda: _equals(lambda: _paths(http, base, sub), {f"{prefix}/s"}))
        async with http.delete(f"{base}/__ds/subscriptions/{sub}") as response:
            assert response.status == 204
        status, _ = await put_sub(http, base, sub, **config)
        assert status == 201
        await eventually(lambda: _equals(lambda: _paths(http, base, sub), {f"{prefix}/s"}))
        tail = await append(http, url, {"n": 1})
        (delivery,) = await box.wait_for(1)
        assert delivery.body["streams"][0]["tail_offset"] == tail


async def test_a_soft_deleted_stream_leaves_the_outbox(
    http: aiohttp.ClientSession, base: str, redis: Any, worker: subprocess.Popen[bytes]
) -> None:
    """A stream kept (soft-deleted) for its forks is gone for its subscribers: its outbox
    entry goes, not taken again and again."""
    sub, prefix = _uid("soft"), _uid("soft")
    source = f"{prefix}/src"
    await create_stream(http, f"{base}/{source}", {"n": 0})
    await put_sub(
        http, base, sub, type="webhook", streams=[source], webhook={"url": "https://93.184.215.14/h"}
    )
    async with http.put(
        f"{base}/{prefix}-fork", headers={**JSON, "Stream-Forked-From": f"/v1/stream/{source}"}
    ) as response:
        assert response.status == 201, await response.text()
    async with http.delete(f"{base}/{source}") as response:
        assert response.status == 204
    sid = keys.stream_id(source)

    async def left() -> bool:
        return await redis.zscore(keys.SUBS_OUTBOX, sid) is None

    await eventually(left)
    await asyncio.sleep(0.3)
    assert await left()


async def test_streams_subscriptions_cannot_name_are_not_linked(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    sub, prefix = _uid("odd"), _uid("odd")
    await put_sub(
        http, base, sub, type="webhook", pattern=f"{prefix}/*", webhook={"url": "https://93.184.215.14/h"}
    )
    async with http.put(f"{base}/{prefix}/x/", headers=JSON) as response:  # "x/" would be acked as "x"
        assert response.status == 201
    await create_stream(http, f"{base}/{prefix}/y")
    await eventually(lambda: _equals(lambda: _paths(http, base, sub), {f"{prefix}/y"}))


async def test_stream_names_beginning_with_the_reserved_letters_are_streams(
    http: aiohttp.ClientSession, base: str
) -> None:
    await create_stream(http, f"{base}/__dsx-{uuid.uuid4().hex[:6]}")


async def test_a_bad_host_is_a_bad_request(http: aiohttp.ClientSession, base: str) -> None:
    config = {"type": "webhook", "pattern": "a/*", "webhook": {"url": "https://93.184.215.14/h"}}
    async with http.put(
        f"{base}/__ds/subscriptions/{_uid('h')}", json=config, headers={"Host": "localhost:99999"}
    ) as r:
        assert r.status == 400


async def test_an_empty_new_stream_wakes_nobody(
    http: aiohttp.ClientSession, base: str, worker: subprocess.Popen[bytes]
) -> None:
    async with receiver(finish) as box:
        sub, prefix = _uid("empty"), _uid("empty")
        await put_sub(http, base, sub, type="webhook", pattern=f"{prefix}/*", webhook={"url": box.url})
        await asyncio.sleep(0.2)
        await create_stream(http, f"{base}/{prefix}/e")
        await eventually(lambda: _equals(lambda: _paths(http, base, sub), {f"{prefix}/e"}))
        await asyncio.sleep(0.5)
        assert box.received == []
        tail = await append(http, f"{base}/{prefix}/e", {"n": 1})
        (delivery,) = await box.wait_for(1)
        assert delivery.body["streams"][0]["tail_offset"] == tail


async def test_the_worker_listens_on_the_wake_channel(redis: Any, worker: subprocess.Popen[bytes]) -> None:
    """Appends announce outbox entries there: without it every wake waits for a poll."""

    async def listening() -> bool:
        ((_, count),) = await redis.pubsub_numsub(keys.SUBS_WAKE_CHANNEL)
        return count >= 1

    await eventually(listening)
