"""Subscription delivery under faults (protocol sections 6-7): delivery workers killed or
paused with a webhook in flight, a gateway process killed under writers, failing, timing
out and slow receivers, Redis restarted, and a worker replaced on Redis Cluster.

Real processes (``durable-streams deliver`` workers, a ``serve`` gateway where it is the
one killed), a real Redis of each test's own (the cluster test: the session's cluster),
loopback receivers (tests/webhooks.py). Every wait is bounded and generous; nothing is
timed tightly. Each test checks a history (``Book``):

- coverage: every acknowledged append (its Stream-Next-Offset) is covered by a delivered
  webhook for its stream whose ``tail_offset`` is at least that offset;
- the subscription's ``acked_offset`` of each stream ends at the stream's final tail (which
  holds every acknowledged append: nothing acknowledged is lost), status ``active``;
- generations only increase: in arrival order, one wake id has one generation and a new
  wake a higher one (a redelivered wake keeps its own);
- cursors move only through wakes the receiver finished: every acked offset seen (polled
  all along) is at most the highest tail of a delivery the receiver answered
  ``{"done": true}``, and never goes backwards; a callback of an old wake is refused
  (409 FENCED) and moves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from gateway.cli.embedded import EmbeddedRedis
from gateway.protocol.subscriptions import BEFORE_FIRST
from gateway.redis_io import keys

from .cluster import Cluster
from .conftest import free_port, serving, wait_ready
from .webhooks import LOOPBACK, Delivery, command, deliver_worker, eventually, receiver

JSON = {"Content-Type": "application/json"}
FAST = ("--deliver-poll-seconds", "0.05")
DONE: tuple[int, Any, float] = (200, {"done": True}, 0.0)
SETTLE_SECONDS = 45.0  # for every wake to be delivered and acked (holds of 6 s, retries, restarts)
CALL = aiohttp.ClientTimeout(total=10)

Policy = Callable[[Delivery, int], tuple[int, Any, float]]  # a delivery, how many came before it


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _finish(_: Delivery, __: int) -> tuple[int, Any, float]:
    return DONE


class Book:
    """One subscription's history: what was acknowledged to writers, what the receiver got
    and answered, and the cursors as the subscription's GET showed them over time."""

    def __init__(self, sub: str, policy: Policy = _finish) -> None:
        self.sub = sub
        self.policy = policy
        self.deliveries: list[Delivery] = []
        self.appended: dict[str, list[str]] = defaultdict(list)  # path -> acknowledged next offsets
        self.unknown = 0  # appends whose outcome the writer never learned
        self.done_tail: dict[str, str] = {}  # path -> highest tail answered {"done": true}
        self.acked_seen: dict[str, str] = {}
        self.statuses: list[str] = []
        self.problems: list[str] = []
        self.urls: dict[str, str] = {}  # path -> stream url, where a test keeps them here

    # -- the receiver ---------------------------------------------------------------

    def answer(self, delivery: Delivery) -> tuple[int, Any, float]:
        if delivery.body["subscription_id"] != self.sub:
            self.problems.append(f"a delivery of {delivery.body['subscription_id']!r} reached {self.sub!r}")
            return 404, {}, 0.0
        n = len(self.deliveries)
        self.deliveries.append(delivery)
        status, body, wait = self.policy(delivery, n)
        if 200 <= status < 300 and isinstance(body, dict) and body.get("done") is True:
            for s in delivery.body["streams"]:  # recorded before the answer leaves: before any ack
                if s["tail_offset"] > self.done_tail.get(s["path"], BEFORE_FIRST):
                    self.done_tail[s["path"]] = s["tail_offset"]
        return status, body, wait

    def of_wake(self, wake: str) -> list[Delivery]:
        return [d for d in self.deliveries if d.body["wake_id"] == wake]

    # -- what was seen ----------------------------------------------------------------

    def observe(self, state: dict[str, Any]) -> None:
        self.statuses.append(state["status"])
        for s in state["streams"]:
            path, acked = s["path"], s["acked_offset"]
            before = self.acked_seen.get(path, BEFORE_FIRST)
            if acked < before:
                self.problems.append(f"{path}: acked offset went back from {before} to {acked}")
            finished = self.done_tail.get(path, BEFORE_FIRST)
            if acked > finished:
                self.problems.append(
                    f"{path}: acked {acked} beyond any delivery answered done ({finished}): "
                    "acked what the receiver never finished"
                )
            self.acked_seen[path] = max(before, acked)

    def delivered_tail(self, path: str) -> str:
        tails = [s["tail_offset"] for d in self.deliveries for s in d.body["streams"] if s["path"] == path]
        return max(tails, default=BEFORE_FIRST)

    def uncovered(self) -> dict[str, tuple[str, str]]:
        """Streams with an acknowledged append no delivery covered: path -> (append, delivered)."""
        out = {}
        for path, offsets in self.appended.items():
            if offsets and self.delivered_tail(path) < max(offsets):
                out[path] = (max(offsets), self.delivered_tail(path))
        return out

    def generation_problems(self) -> list[str]:
        out: list[str] = []
        gen_of: dict[str, int] = {}
        last = 0
        for i, d in enumerate(self.deliveries):
            wake, gen = d.body["wake_id"], d.body["generation"]
            if gen_of.setdefault(wake, gen) != gen:
                out.append(f"delivery {i}: wake {wake} came with generations {gen_of[wake]} and {gen}")
            if gen < last:
                out.append(f"delivery {i}: generation {gen} after {last}")
            last = max(last, gen)
        if len(set(gen_of.values())) != len(gen_of):
            out.append(f"two wakes share a generation: {gen_of}")
        return out

    def summary(self) -> str:
        gens = [
            (d.body["generation"], [s["tail_offset"][-8:] for s in d.body["streams"]])
            for d in self.deliveries
        ]
        return (
            f"{len(self.deliveries)} deliveries {gens}; acked seen {self.acked_seen}; "
            f"uncovered {self.uncovered()}; problems {self.problems[:5]}"
        )

    # -- watching and settling ----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watching(self, http: aiohttp.ClientSession, base: str) -> AsyncIterator[None]:
        """The subscription's GET every 0.2 s for the block (unreachable meanwhile: skipped)."""

        async def loop() -> None:
            while True:
                state = await sub_state(http, base, self.sub)
                if state is not None:
                    self.observe(state)
                await asyncio.sleep(0.2)

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def settle(
        self, http: aiohttp.ClientSession, base: str, urls: dict[str, str], timeout: float = SETTLE_SECONDS
    ) -> None:
        """Until every acknowledged append is covered and every stream acked at its tail
        (status active); then the whole history is checked."""
        last: dict[str, Any] = {}

        async def check() -> bool:
            state = await sub_state(http, base, self.sub)
            if state is None:
                return False
            self.observe(state)
            acked = {s["path"]: s["acked_offset"] for s in state["streams"]}
            for path, url in urls.items():
                tail = await tail_of(http, url)
                last[path] = (tail, acked.get(path))
                if tail is None or acked.get(path) != tail:
                    return False
            last["status"] = state["status"]
            return not self.uncovered() and state["status"] == "active"

        try:
            await eventually(check, timeout, every=0.2)
        except AssertionError:
            raise AssertionError(
                f"{self.sub} not settled after {timeout} s: (tail, acked) {last}; {self.summary()}"
            ) from None
        for path, (tail, _) in ((p, last[p]) for p in urls):
            offsets = self.appended.get(path)
            assert not offsets or tail >= max(offsets), f"{path}: acknowledged {max(offsets)}, tail {tail}"
        self.verify()

    def verify(self) -> None:
        assert not self.problems, f"{self.problems}; {self.summary()}"
        problems = self.generation_problems()
        assert not problems, f"{problems}; {self.summary()}"
        assert not self.uncovered(), self.summary()


# -- HTTP helpers ---------------------------------------------------------------------


async def sub_state(http: aiohttp.ClientSession, base: str, sub: str) -> dict[str, Any] | None:
    try:
        async with http.get(f"{base}/__ds/subscriptions/{sub}", timeout=CALL) as response:
            return await response.json() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def tail_of(http: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with http.head(url, timeout=CALL) as response:
            return response.headers["Stream-Next-Offset"] if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def put_sub(http: aiohttp.ClientSession, base: str, sub: str, hook: str, **config: Any) -> None:
    body = {"type": "webhook", "webhook": {"url": hook}, **config}
    async with http.put(f"{base}/__ds/subscriptions/{sub}", json=body, timeout=CALL) as response:
        assert response.status == 201, await response.text()


async def delete_sub(http: aiohttp.ClientSession, base: str, sub: str) -> None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with http.delete(f"{base}/__ds/subscriptions/{sub}", timeout=CALL):
            pass


async def create(http: aiohttp.ClientSession, book: Book, base: str, path: str, body: Any) -> str:
    """A JSON stream with a first message (an acknowledged append too); its URL."""
    url = f"{base}/{path}"
    async with http.put(url, data=json.dumps(body), headers=JSON, timeout=CALL) as response:
        assert response.status == 201, await response.text()
        offset = response.headers.get("Stream-Next-Offset")
    book.appended[path].append(offset or await tail_of(http, url) or "")
    return url


async def append(http: aiohttp.ClientSession, book: Book, base: str, path: str, body: Any) -> str:
    async with http.post(f"{base}/{path}", data=json.dumps(body), headers=JSON, timeout=CALL) as response:
        assert response.status in (200, 204), await response.text()
        offset = response.headers["Stream-Next-Offset"]
    book.appended[path].append(offset)
    return offset


async def try_append(http: aiohttp.ClientSession, book: Book, base: str, path: str, body: Any) -> str | None:
    """An append whose outcome may be unknown (the gateway dies, Redis is away): its offset
    if acknowledged, else None."""
    try:
        async with http.post(f"{base}/{path}", data=json.dumps(body), headers=JSON, timeout=CALL) as response:
            if response.status in (200, 204):
                offset = response.headers["Stream-Next-Offset"]
                book.appended[path].append(offset)
                return offset
            # Redis away: 503 refused (nothing written) or 504 outcome unknown (it died under
            # the call): not acknowledged either way, so nothing this history must cover.
            if response.status not in (503, 504):
                book.problems.append(f"append to {path} answered {response.status}: {await response.text()}")
    except (aiohttp.ClientError, TimeoutError):
        pass
    book.unknown += 1
    return None


async def acked_now(http: aiohttp.ClientSession, base: str, sub: str) -> dict[str, str]:
    state = await sub_state(http, base, sub)
    return {} if state is None else {s["path"]: s["acked_offset"] for s in state["streams"]}


async def stale_callback_is_fenced(http: aiohttp.ClientSession, base: str, book: Book, old: Delivery) -> None:
    """A callback of a wake that is over (done, with its acks) is refused and moves no cursor."""
    body = old.body
    before = await acked_now(http, base, book.sub)
    request = {
        "wake_id": body["wake_id"],
        "generation": body["generation"],
        "acks": [{"stream": s["path"], "offset": s["tail_offset"]} for s in body["streams"]],
        "done": True,
    }
    headers = {"Authorization": f"Bearer {body['callback_token']}"}
    async with http.post(body["callback_url"], json=request, headers=headers, timeout=CALL) as response:
        status, answer = response.status, await response.json(content_type=None)
    assert (status, answer["error"]["code"]) == (409, "FENCED"), answer
    assert await acked_now(http, base, book.sub) == before


# -- processes ----------------------------------------------------------------------


def gateway_process(
    redis_url: str, port: int, log: Path
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """``durable-streams serve`` as its own process (to SIGKILL), loopback webhooks allowed."""
    return command("serve", "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url,
                   "--webhook-allow", LOOPBACK, "--log-level", "warning", log=log)  # fmt: skip


def signal_worker(procs: dict[str, subprocess.Popen[bytes]], name: str, signum: int) -> None:
    proc = procs[name]
    if proc.poll() is None:
        os.kill(proc.pid, signum)


# -- 1. a worker killed with a webhook in flight ----------------------------------------


async def test_a_worker_killed_mid_webhook_leaves_the_wake_to_a_fresh_one(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis
) -> None:
    """The receiver stalls the first delivery; its worker is SIGKILLed meanwhile. Appends
    go on with no worker. A fresh worker delivers the same wake again once the dead one's
    hold (webhook timeout + 5 s) runs out, then a wake for what was appended meanwhile."""
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def policy(_: Delivery, n: int) -> tuple[int, Any, float]:
        if n == 0:
            signal_worker(procs, "first", signal.SIGKILL)  # dies waiting for this answer
            return 200, {"done": True}, 3.0
        return DONE

    sub, prefix = _uid("kw"), _uid("kw")
    book = Book(sub, policy)
    async with serving(own_redis.url, webhook_allow=LOOPBACK) as base, receiver(book.answer) as box:
        await put_sub(http, base, sub, box.url, pattern=f"{prefix}/*")
        async with book.watching(http, base):
            urls = {f"{prefix}/a": await create(http, book, base, f"{prefix}/a", {"n": 0})}
            with deliver_worker(own_redis.url, *FAST, "--webhook-timeout", "1") as first:
                procs["first"] = first
                await box.wait_for(1, timeout=20)
                assert first.wait(10) == -signal.SIGKILL
            for n in range(1, 4):  # no worker runs: recorded in the outbox, delivered later
                await append(http, book, base, f"{prefix}/a", {"n": n})
            with deliver_worker(own_redis.url, *FAST):
                await book.settle(http, base, urls)
        lost, again = book.deliveries[0], book.deliveries[1]
        assert (again.body["wake_id"], again.body["generation"]) == (
            lost.body["wake_id"],
            lost.body["generation"],
        ), "the wake in flight when its worker died is delivered again (at-least-once)"
        assert again.body["streams"] == lost.body["streams"]
        assert book.deliveries[-1].body["generation"] > lost.body["generation"]
        await stale_callback_is_fenced(http, base, book, lost)


# -- 2. a gateway process killed under writers -------------------------------------------


async def test_a_gateway_killed_under_writers_loses_no_wake(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Eight writers append to four streams of a pattern subscription through a gateway
    process, which is SIGKILLed mid-stream and started again: every append acknowledged
    (before the kill or after) is covered by a webhook, and the cursors end at the tails
    (which include appends whose answer the kill swallowed)."""
    sub, prefix = _uid("kg"), _uid("kg")
    book = Book(sub)
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1/stream"
    log = tmp_path / "gateway.log"
    paths = [f"{prefix}/s{i}" for i in range(4)]
    stop = asyncio.Event()

    async def writer(session: aiohttp.ClientSession, path: str, tag: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if await try_append(session, book, base, path, {"w": tag, "n": n}) is None:
                await asyncio.sleep(0.05)

    def acknowledged() -> int:
        return sum(len(v) for v in book.appended.values())

    async def at_least(count: int) -> bool:
        return acknowledged() >= count

    async with receiver(book.answer) as box:
        with gateway_process(own_redis.url, port, log) as gateway:
            await asyncio.to_thread(wait_ready, port, gateway)
            await put_sub(http, base, sub, box.url, pattern=f"{prefix}/*")
            urls = {path: await create(http, book, base, path, {"n": 0}) for path in paths}
            with deliver_worker(own_redis.url, *FAST):
                async with (
                    book.watching(http, base),
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
                ):
                    writers = [asyncio.create_task(writer(session, paths[i % 4], i)) for i in range(8)]
                    try:
                        await eventually(lambda: at_least(150), timeout=30)
                        gateway.kill()  # SIGKILL, appends in flight
                        gateway.wait()
                        before_kill = acknowledged()
                        await asyncio.sleep(0.5)
                        with gateway_process(own_redis.url, port, log) as again:
                            await asyncio.to_thread(wait_ready, port, again)
                            await eventually(lambda: at_least(before_kill + 100), timeout=30)
                            stop.set()
                            await asyncio.gather(*writers)
                            await book.settle(http, base, urls)
                    finally:
                        stop.set()
                        for task in writers:
                            task.cancel()
                        await asyncio.gather(*writers, return_exceptions=True)
    assert before_kill >= 150 and book.unknown >= 1, (before_kill, book.unknown)


# -- 3. timeouts and 5xx are retried ------------------------------------------------------


async def test_timeouts_and_server_errors_are_retried_with_growing_gaps(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis
) -> None:
    """The receiver times out (sleeps past --webhook-timeout 1), answers 503, times out
    again, then finishes: the same wake is retried after about 1, 2 and 4 s (±20%, from
    each failure), the subscription shows status "failed" meanwhile and "active" after,
    and what was appended while it failed comes in the next wake."""
    plan: list[tuple[int, Any, float]] = [
        (200, {"done": True}, 2.5),
        (503, {}, 0.0),
        (200, {"done": True}, 2.5),
    ]
    timed_out = [True, False, True]

    def policy(_: Delivery, n: int) -> tuple[int, Any, float]:
        return plan[n] if n < len(plan) else DONE

    sub, prefix = _uid("rt"), _uid("rt")
    book = Book(sub, policy)
    async with serving(own_redis.url, webhook_allow=LOOPBACK) as base, receiver(book.answer) as box:
        await put_sub(http, base, sub, box.url, pattern=f"{prefix}/*")

        async def status_is(value: str) -> bool:
            state = await sub_state(http, base, sub)
            return state is not None and state["status"] == value

        async with book.watching(http, base):
            urls = {f"{prefix}/s": await create(http, book, base, f"{prefix}/s", {"n": 0})}
            with deliver_worker(own_redis.url, *FAST, "--webhook-timeout", "1"):
                await box.wait_for(2, timeout=20)
                await eventually(lambda: status_is("failed"), timeout=10)
                await append(http, book, base, f"{prefix}/s", {"n": 1})  # while failing
                await box.wait_for(4, timeout=40)
                await book.settle(http, base, urls)
        attempts = book.deliveries[:4]
        assert len({d.body["wake_id"] for d in attempts}) == 1, book.summary()  # one wake, retried
        gaps = [
            later.at - (earlier.at + (1.0 if slow else 0.0))
            for earlier, later, slow in zip(attempts, attempts[1:], timed_out, strict=False)
        ]
        # 1 s, 2 s, 4 s, each ±20%: bounded below by the schedule, above loosely (a noisy machine)
        for gap, base_s in zip(gaps, (1.0, 2.0, 4.0), strict=True):
            assert 0.8 * base_s - 0.5 <= gap <= 1.2 * base_s + 3.0, gaps
        assert gaps[2] > gaps[0] + 1.0, gaps
        assert "failed" in book.statuses and book.statuses[-1] == "active"
        assert book.deliveries[-1].body["streams"][0]["tail_offset"] == max(book.appended[f"{prefix}/s"])


# -- 4. a slow receiver does not hold up the others ----------------------------------------


async def test_a_slow_receiver_does_not_stall_other_subscriptions(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis
) -> None:
    """Subscription A's receiver takes 8 s over its delivery; while it does, B's wakes for
    fresh appends arrive one after another, each within seconds (not after A's 8 s)."""
    slow_seconds = 8.0

    def slow_policy(_: Delivery, n: int) -> tuple[int, Any, float]:
        return (200, {"done": True}, slow_seconds) if n == 0 else DONE

    sub_a, sub_b, prefix = _uid("slow"), _uid("fast"), _uid("sf")
    slow, fast = Book(sub_a, slow_policy), Book(sub_b)
    a_path, b_path = f"{prefix}-a/s", f"{prefix}-b/s"
    async with (
        serving(own_redis.url, webhook_allow=LOOPBACK) as base,
        receiver(slow.answer) as box_a,
        receiver(fast.answer) as box_b,
    ):
        await put_sub(http, base, sub_a, box_a.url, pattern=f"{prefix}-a/*")
        await put_sub(http, base, sub_b, box_b.url, pattern=f"{prefix}-b/*")
        async with slow.watching(http, base), fast.watching(http, base):
            a_urls = {a_path: await create(http, slow, base, a_path, {"n": 0})}
            b_urls = {b_path: await create(http, fast, base, b_path, {"n": 0})}
            with deliver_worker(own_redis.url, *FAST, "--webhook-timeout", "30"):
                await box_a.wait_for(1, timeout=20)
                stuck_until = slow.deliveries[0].at + slow_seconds
                await box_b.wait_for(1, timeout=20)
                latencies = []
                for n in range(1, 6):
                    offset = await append(http, fast, base, b_path, {"n": n})
                    await append(http, slow, base, a_path, {"n": n})  # A's work waits behind its wake
                    started = time.monotonic()

                    async def covered(offset: str = offset) -> bool:
                        return fast.delivered_tail(b_path) >= offset

                    try:
                        await eventually(covered, timeout=20)
                    except AssertionError:
                        raise AssertionError(
                            f"B's wake {n} for {offset} never came; A: {slow.summary()}; B: {fast.summary()}"
                        ) from None
                    latencies.append(round(time.monotonic() - started, 2))
                assert fast.deliveries[-1].at < stuck_until, ("A was no longer stuck", latencies)
                assert max(latencies) < 4.0, latencies  # well under A's 8 s
                await fast.settle(http, base, b_urls)
                await slow.settle(http, base, a_urls)
        assert len(slow.deliveries) >= 2 and len(fast.deliveries) >= 6


# -- 5. a paused worker is fenced ------------------------------------------------------------


async def test_a_paused_worker_cannot_ack_a_later_wake(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis
) -> None:
    """Worker 1 delivers a wake and is SIGSTOPped with it in flight, past its hold (6 s);
    worker 2 delivers the same wake again and the receiver finishes it. Appends after that
    ack make a new wake; as it goes out (its first attempt fails), worker 1 continues and
    reports its stalled delivery (answered {"done": true}; by then past worker 1's own
    webhook timeout too, so 'done' or 'failed'): fenced either way. Nothing is acked that
    the receiver did not finish, and the later appends are delivered."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    first_gen: list[int] = []
    resumed: list[float] = []

    def policy(delivery: Delivery, n: int) -> tuple[int, Any, float]:
        gen = delivery.body["generation"]
        if n == 0:
            first_gen.append(gen)
            signal_worker(procs, "w1", signal.SIGSTOP)  # paused waiting for this answer
            return 200, {"done": True}, 0.3
        if gen > first_gen[0] and not resumed:
            resumed.append(time.monotonic())
            signal_worker(procs, "w1", signal.SIGCONT)  # its stale report lands while this wake is out
            return 503, {}, 0.5
        return DONE

    async with _paused_first_worker(http, own_redis, "ps", policy, procs, second_timeout="1") as (
        base,
        box,
        book,
    ):
        first, second = book.deliveries[:2]
        assert second.body["wake_id"] == first.body["wake_id"], book.summary()
        path = next(iter(book.urls))

        async def acked_first() -> bool:
            return (await acked_now(http, base, book.sub)).get(path) == first.body["streams"][0][
                "tail_offset"
            ]

        await eventually(acked_first, timeout=20)
        for n in range(1, 4):  # after worker 2's ack, worker 1 still paused
            await append(http, book, base, path, {"n": n})
        await box.wait_for(3, timeout=20)
        await book.settle(http, base, book.urls)
        assert resumed, "worker 1 was never continued"
        assert procs["w1"].poll() is None, "worker 1 died"
        await asyncio.sleep(1.0)  # anything worker 1 still had to say
        await book.settle(http, base, book.urls)
        later = [d for d in book.deliveries if d.body["generation"] > first.body["generation"]]
        assert later and later[-1].body["streams"][0]["tail_offset"] == max(book.appended[path])
        await stale_callback_is_fenced(http, base, book, first)


async def test_a_paused_worker_cannot_undo_its_successor_in_the_same_wake(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis
) -> None:
    """As above, but worker 1 continues while worker 2 is delivering the very same wake
    (same generation, only the workers' tokens tell them apart): worker 1's report of its
    stalled delivery is fenced, so worker 2's {"done": true} counts, and the wake is not
    failed nor delivered a third time."""
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def policy(_: Delivery, n: int) -> tuple[int, Any, float]:
        if n == 0:
            signal_worker(procs, "w1", signal.SIGSTOP)
            return 200, {"done": True}, 0.3
        if n == 1:
            signal_worker(procs, "w1", signal.SIGCONT)  # reports while worker 2 holds the wake
            return 200, {"done": True}, 1.0
        return DONE

    async with _paused_first_worker(http, own_redis, "pt", policy, procs, second_timeout="5") as (
        base,
        _,
        book,
    ):
        await book.settle(http, base, book.urls)
        await asyncio.sleep(3.0)  # a retry of the wake would come within ~1.2 s
        assert procs["w1"].poll() is None, "worker 1 died"
        first = book.deliveries[0]
        assert len(book.of_wake(first.body["wake_id"])) == 2, book.summary()
        assert len(book.deliveries) == 2 and "failed" not in book.statuses, (book.statuses, book.summary())
        await stale_callback_is_fenced(http, base, book, first)


@contextlib.asynccontextmanager
async def _paused_first_worker(
    http: aiohttp.ClientSession,
    own_redis: EmbeddedRedis,
    tag: str,
    policy: Policy,
    procs: dict[str, subprocess.Popen[bytes]],
    second_timeout: str,
) -> AsyncIterator[tuple[str, Any, Book]]:
    """The scene of the two paused-worker tests: a pattern subscription, one stream made,
    worker 1 (webhook timeout 1 s) takes the first delivery (the policy pauses it there),
    worker 2 starts and gets the second; yields (gateway url, receiver, book) with both
    workers still running (``procs["w1"]`` is worker 1)."""
    sub, prefix = _uid(tag), _uid(tag)
    book = Book(sub, policy)
    path = f"{prefix}/s"
    async with serving(own_redis.url, webhook_allow=LOOPBACK) as base, receiver(book.answer) as box:
        await put_sub(http, base, sub, box.url, pattern=f"{prefix}/*")
        async with book.watching(http, base):
            book.urls = {path: await create(http, book, base, path, {"n": 0})}
            with deliver_worker(own_redis.url, *FAST, "--webhook-timeout", "1") as w1:
                procs["w1"] = w1
                await box.wait_for(1, timeout=20)
                with deliver_worker(own_redis.url, *FAST, "--webhook-timeout", second_timeout):
                    await box.wait_for(2, timeout=30)
                    yield base, box, book


# -- 6. Redis restarted -----------------------------------------------------------------------


async def test_redis_restarted_with_a_wake_pending(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis
) -> None:
    """Redis (AOF, fsync always) is SIGKILLed while a wake is out (its worker cannot report)
    and appends are pending, and started again: the gateway and the worker recover, the
    wake is delivered again and what was appended before and after is covered."""
    killed = asyncio.Event()

    def policy(_: Delivery, n: int) -> tuple[int, Any, float]:
        if n == 1:
            own_redis.kill()
            killed.set()
            return 503, {}, 0.0
        return DONE

    sub, prefix = _uid("rr"), _uid("rr")
    book = Book(sub, policy)
    paths = [f"{prefix}/a", f"{prefix}/b"]
    async with serving(own_redis.url, webhook_allow=LOOPBACK) as base, receiver(book.answer) as box:
        await put_sub(http, base, sub, box.url, pattern=f"{prefix}/*")
        async with book.watching(http, base):
            urls = {path: await create(http, book, base, path, {"n": 0}) for path in paths}
            with deliver_worker(own_redis.url, *FAST, "--webhook-timeout", "1") as worker:
                await box.wait_for(1, timeout=20)
                for n in range(1, 4):
                    for path in paths:
                        await try_append(http, book, base, path, {"n": n})
                await asyncio.wait_for(killed.wait(), 20)
                await asyncio.sleep(1.0)
                await try_append(http, book, base, paths[0], {"down": True})  # refused or unknown
                await asyncio.to_thread(own_redis.start)

                async def appended_after(path: str) -> bool:
                    return await try_append(http, book, base, path, {"after": True}) is not None

                for path in paths:
                    await eventually(lambda path=path: appended_after(path), timeout=30, every=0.2)
                await book.settle(http, base, urls)
                assert worker.poll() is None
        assert (
            len(book.deliveries) >= 3
            and book.deliveries[2].body["wake_id"] == book.deliveries[1].body["wake_id"]
        )


# -- 7. Redis Cluster ----------------------------------------------------------------------------


def paths_on_each_primary(cluster: Cluster, prefix: str) -> list[str]:
    """One stream path under ``prefix/`` whose keys live on each primary."""
    found: dict[int, str] = {}
    while len(found) < len(cluster.primaries):
        path = f"{prefix}/s-{uuid.uuid4().hex[:8]}"
        owner = cluster.primary_of(keys.stream_keys(keys.stream_id(path))[0])
        found.setdefault(owner.port, path)
    return list(found.values())


async def test_cluster_streams_on_every_primary_and_a_replaced_worker(
    http: aiohttp.ClientSession, redis_cluster: Cluster
) -> None:
    """Streams on every primary under one pattern subscription, a --redis-cluster worker:
    every wake delivered. The worker is SIGKILLed; appends (and a new stream) made while
    none runs announce themselves to nobody; a new worker finds them in the slots' outboxes
    (its sweep) and delivers them."""
    cluster = redis_cluster
    sub, prefix = _uid("cl"), _uid("cl")
    book = Book(sub)
    paths = paths_on_each_primary(cluster, prefix)
    outboxes = {keys.subs_outbox(keys.stream_id(p), True) for p in paths}
    assert len(outboxes) == len(paths)
    worker_flags = (*FAST, "--deliver-sweep-seconds", "1")
    try:
        async with (
            serving(cluster.seed_url, redis_cluster=True, webhook_allow=LOOPBACK) as base,
            receiver(book.answer) as box,
        ):
            await put_sub(http, base, sub, box.url, pattern=f"{prefix}/*")
            try:
                async with book.watching(http, base):
                    urls = {p: await create(http, book, base, p, {"n": 0}) for p in paths}
                    with deliver_worker(cluster.seed_url, *worker_flags, cluster=True) as first:
                        for n in range(1, 3):
                            for path in paths:
                                await append(http, book, base, path, {"n": n})
                        await book.settle(http, base, urls)
                        first.kill()
                        first.wait()
                    delivered = len(book.deliveries)
                    for path in paths:  # nobody hears these announced
                        await append(http, book, base, path, {"n": 3})
                    late = f"{prefix}/late-{uuid.uuid4().hex[:6]}"
                    urls[late] = await create(http, book, base, late, {"n": 0})
                    with deliver_worker(cluster.seed_url, *worker_flags, cluster=True):
                        await book.settle(http, base, urls)
                        assert len(book.deliveries) > delivered
                        for path in urls:  # and the replacement's ordinary path
                            await append(http, book, base, path, {"n": 4})
                        await book.settle(http, base, urls)
            finally:
                await delete_sub(http, base, sub)
    finally:
        cluster.heal()


# -- a stream made as the first worker starts -------------------------------------------------


async def test_streams_created_as_the_first_worker_starts_are_all_linked(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis
) -> None:
    """A pattern subscription made while no delivery worker runs; streams are created every
    50 ms while the first worker starts. Each is created after the subscription, so each is
    linked (before its first byte) and its first message delivered: the ones the worker's
    start-up backfill scanned, and the ones created after it (the outbox)."""
    sub, prefix = _uid("ws"), _uid("ws")
    book = Book(sub)
    async with serving(own_redis.url, webhook_allow=LOOPBACK) as base, receiver(book.answer) as box:
        await put_sub(http, base, sub, box.url, pattern=f"{prefix}/*")
        urls = {f"{prefix}/c0": await create(http, book, base, f"{prefix}/c0", {"n": 0})}
        with deliver_worker(own_redis.url, *FAST):
            started = time.monotonic()
            while time.monotonic() - started < 3.0:
                path = f"{prefix}/c{len(urls)}"
                urls[path] = await create(http, book, base, path, {"n": 0})
                await asyncio.sleep(0.05)

            async def linked() -> set[str]:
                return set(await acked_now(http, base, sub))

            with contextlib.suppress(AssertionError):
                await eventually(lambda: _all_linked(linked, set(urls)), timeout=10, every=0.2)
            missed = sorted(set(urls) - await linked(), key=lambda p: int(p.rsplit("/c", 1)[1]))
            assert not missed, f"{len(missed)} of {len(urls)} streams never linked: {missed}"
            await book.settle(http, base, urls)


async def _all_linked(linked: Callable[[], Any], paths: set[str]) -> bool:
    return paths <= await linked()


# -- appends racing the link of an existing stream ---------------------------------------------


async def test_appends_racing_the_backfill_link_of_existing_streams_are_delivered(
    http: aiohttp.ClientSession, own_redis: EmbeddedRedis
) -> None:
    """Forty existing streams get appends, one writer each, until the stream is linked
    (its links key exists); meanwhile a pattern subscription over them is made and the
    worker's backfill links each at its tail (spec 6.2: history is not replayed). Whatever
    lies past the offset a stream was linked at was appended after the subscription was
    made: it is delivered, so each stream's acked offset ends at its tail."""
    sub, prefix = _uid("lw"), _uid("lw")
    book = Book(sub)
    client = aioredis.Redis.from_url(own_redis.url)
    paths = [f"{prefix}/s{i}" for i in range(40)]
    try:
        async with serving(own_redis.url, webhook_allow=LOOPBACK) as base, receiver(book.answer) as box:
            urls = {p: await create(http, book, base, p, {"n": 0}) for p in paths}
            with deliver_worker(own_redis.url, *FAST):
                await eventually(lambda: client.exists(keys.SUBS_WORKER_ALIVE), timeout=20)

                async def writer(path: str) -> None:
                    links, n = keys.stream_subs(keys.stream_id(path)), 0
                    while not await client.exists(links):
                        n += 1
                        await append(http, book, base, path, {"n": n})

                writers = [asyncio.create_task(writer(p)) for p in paths]
                try:
                    await asyncio.sleep(0.3)
                    await put_sub(http, base, sub, box.url, pattern=f"{prefix}/*")
                    await asyncio.wait_for(asyncio.gather(*writers), 30)
                finally:
                    for task in writers:
                        task.cancel()
                    await asyncio.gather(*writers, return_exceptions=True)
                behind: dict[str, tuple[str, str | None]] = {}

                async def all_acked() -> bool:
                    acked = await acked_now(http, base, sub)
                    behind.clear()
                    for path, url in urls.items():
                        tail = await tail_of(http, url)
                        if acked.get(path) != tail:
                            behind[path] = (acked.get(path, "unlinked"), tail)
                    return not behind

                with contextlib.suppress(AssertionError):
                    await eventually(all_acked, timeout=10, every=0.5)
                assert not behind, (
                    f"{len(behind)} of {len(paths)} streams keep an acknowledged append past their "
                    f"acked offset that no wake delivers ((acked, tail) {behind}); "
                    f"{len(book.deliveries)} deliveries"
                )
    finally:
        await client.aclose()
