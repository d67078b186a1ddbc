"""http/fastpath.py: appends answered on the connection itself say exactly what aiohttp's
path says, in request order, with whatever else the connection carries; what is not
plain goes to aiohttp, byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from gateway.telemetry import metrics

from .conftest import read_all, serving

# Small limits, so 413 and the fast path's own body bound are both cheap to reach.
LIMITS = {"max_body_bytes": 4096}


def fast_answers() -> float:
    metrics.flush_requests()
    return metrics.FAST_PATH._value.get()


@contextlib.asynccontextmanager
async def both_paths(redis_url: str, **options: object) -> AsyncIterator[tuple[str, str]]:
    """Two gateways on one Redis with ``options``: the fast path on, and off."""
    async with (
        serving(redis_url, **options) as fast,
        serving(redis_url, fast_appends=False, **options) as full,
    ):
        yield fast, full


@pytest.fixture(scope="module")
async def pair(redis_url: str) -> AsyncIterator[tuple[str, str]]:
    async with both_paths(redis_url, **LIMITS) as gateways:
        yield gateways


class Raw:
    """One connection, written to and read from as bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, base: str) -> Raw:
        url = aiohttp.client.URL(base)
        return cls(*await asyncio.open_connection(url.host, url.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, head_only: bool = False, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
        """The next response: status, headers (lower-case names) and body; TimeoutError when
        its status line has not come in ``timeout`` seconds (nothing of it read then)."""
        status_line = await asyncio.wait_for(self.reader.readline(), timeout)
        assert status_line.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), status_line
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            assert name.lower() not in headers, name
            headers[name.lower()] = value.strip()
        status = int(status_line.split()[1])
        length = 0 if head_only or status in (204, 304) else int(headers.get("content-length", 0))
        return status, headers, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def post(path: str, body: bytes = b"", *fields: str, content_type: str | None = "text/plain") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    lines += [*fields, f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def request(method: str, path: str, *fields: str) -> bytes:
    return ("\r\n".join([f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *fields]) + "\r\n\r\n").encode()


async def answered(base: str, name: str, steps: list[Callable[[str], bytes]]) -> list[Answer]:
    """``steps`` (requests made from the stream's path) sent in turn on one connection: the
    answers, comparable across gateways and streams."""
    raw = await Raw.open(base)
    try:
        path = aiohttp.client.URL(f"{base}/{name}").path
        answers = []
        for step in steps:
            await raw.send(step(path))
            answers.append(comparable(await raw.answer(), name))
        return answers
    finally:
        await raw.close()


Answer = tuple[int, dict[str, str], bytes]


def comparable(answer: tuple[int, dict[str, str], bytes], name: str) -> tuple[int, dict[str, str], bytes]:
    status, headers, body = answer
    kept = {k: v.replace(name, "NAME") for k, v in headers.items() if k not in ("date", "etag")}
    return status, kept, body.replace(name.encode(), b"NAME")


# Each case: the stream's content type, then the requests sent in turn (bytes made by
# a function of the stream's path).
CASES = {
    "appends": ("text/plain", [lambda p: post(p, b"one"), lambda p: post(p, b"two")]),
    "producer": (
        "text/plain",
        [
            lambda p: post(p, b"a", "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 0"),
            lambda p: post(p, b"a", "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 0"),  # a duplicate
            lambda p: post(p, b"b", "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 5"),  # a gap
            lambda p: post(p, b"c", "Producer-Id: w", "Producer-Epoch: x", "Producer-Seq: 1"),  # bad
            lambda p: post(p, b"c", "Producer-Id: w", "Producer-Seq: 1"),  # incomplete
        ],
    ),
    "stream-seq": (
        "text/plain",
        [lambda p: post(p, b"a", "Stream-Seq: 5"), lambda p: post(p, b"b", "Stream-Seq: 4")],
    ),
    "json": (
        "application/json",
        [
            lambda p: post(p, b'[{"a":1},2]', content_type="application/json"),
            lambda p: post(p, b"[]", content_type="application/json"),
            lambda p: post(p, b"{nope", content_type="application/json"),
            lambda p: post(p, b"x", content_type="text/plain"),  # the wrong type
        ],
    ),
    "close": (
        "text/plain",
        [
            lambda p: post(p, b"", content_type=None),  # empty, not a close: 400
            lambda p: post(p, b"x", content_type=None),  # a body without a type: 400
            lambda p: post(p, b"last", "Stream-Closed: true"),
            lambda p: post(p, b"more"),  # closed: 409
            lambda p: post(p, b"", "Stream-Closed: true", content_type=None),
        ],
    ),
    "conditions": (
        "text/plain",
        [
            lambda p: post(p, b"a", 'If-Match: "nope"'),
            lambda p: post(p, b"a", "Stream-Expected-Offset: 0000000000000001_0000000000000000"),
            lambda p: post(p, b"a", "Stream-Expected-Offset: 0000000000000001_0000000000000000"),
        ],
    ),
    "limits": ("text/plain", [lambda p: post(p, b"x" * 4096), lambda p: post(p, b"x" * 4097)]),
    "missing": (None, [lambda p: post(p, b"x")]),
    "foreign-host": (
        "text/plain",
        [lambda p: post(p, b"x").replace(b"Host: 127.0.0.1", b"Host: evil.example")],
    ),
    "others": (
        "text/plain",
        [
            lambda p: post(p + "?x=1", b"q"),
            lambda p: post(p.replace("/v1/stream/", "/v1/stream/./"), b"d"),
            lambda p: post(p, b"o", "Origin: http://localhost:3000"),
            lambda p: post(p, b"g", "Content-Encoding: identity"),
            lambda p: request("GET", p + "?offset=-1"),
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_same_answers_as_aiohttps_path(
    pair: tuple[str, str], http: aiohttp.ClientSession, case: str
) -> None:
    media, steps = CASES[case]
    answers = []
    before = fast_answers()
    for base in pair:
        name = f"fp-{case}-{uuid.uuid4().hex[:8]}"
        if media is not None:
            async with http.put(f"{base}/{name}", headers={"Content-Type": media}) as r:
                assert r.status == 201
        answers.append(await answered(base, name, steps))
        if base == pair[0]:
            fast = fast_answers() - before
    assert answers[0] == answers[1]
    assert fast_answers() - before == fast  # the full path's gateway answered none itself
    plain = {"appends": 2, "producer": 5, "stream-seq": 2, "json": 4, "close": 5, "conditions": 3}
    assert fast == plain.get(case, {"limits": 1, "missing": 1, "foreign-host": 1}.get(case, 0))


ADMIN, READER, WRITER = "admin-token-" + "a" * 24, "reader-token-" + "b" * 24, "writer-token-" + "c" * 24


@pytest.fixture(scope="module")
async def auth_pair(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, str]]:
    """``pair`` with access control on (bearer tokens)."""
    tokens = tmp_path_factory.mktemp("fastpath-auth") / "tokens.json"
    grants = [("admin", ADMIN, "admin:"), ("reader", READER, "read:"), ("writer", WRITER, "write:fp-auth-w")]
    tokens.write_text(json.dumps({"tokens": [{"name": n, "token": t, "grants": g} for n, t, g in grants]}))
    async with both_paths(redis_url, **LIMITS, auth_tokens_file=str(tokens)) as gateways:
        yield gateways


async def test_the_same_answers_with_access_control_on(
    auth_pair: tuple[str, str], http: aiohttp.ClientSession
) -> None:
    def bearer(token: str) -> str:
        return f"Authorization: Bearer {token}"

    steps = [
        lambda p: post(p, b"a", bearer(ADMIN)),
        lambda p: post(p, b"b", bearer(WRITER)),  # its grant covers fp-auth-w... only
        lambda p: post(p, b"c", bearer(READER)),  # 403
        lambda p: post(p, b"d", bearer("nope-" + "x" * 30)),  # 401
        lambda p: post(p, b"e", "Authorization: Basic eDp5"),  # 401
        lambda p: post(p, b"f"),  # anonymous, without anonymous grants: 401
        lambda p: request("GET", p + "?offset=-1", bearer(READER)),
    ]
    answers = []
    before = fast_answers()
    for base, kind in zip(auth_pair, ("w", "x"), strict=True):  # fp-auth-w... is the writer's
        name = f"fp-auth-{kind}{uuid.uuid4().hex[:8]}"
        async with http.put(
            f"{base}/{name}", headers={"Content-Type": "text/plain", "Authorization": f"Bearer {ADMIN}"}
        ) as r:
            assert r.status == 201
        answers.append(await answered(base, name, steps))
        if kind == "w":
            fast = fast_answers() - before
    assert [a[0] for a in answers[0]] == [204, 204, 403, 401, 401, 401, 200]
    assert answers[1][1][0] == 403  # the writer may not write to fp-auth-x...
    assert answers[0][:1] + answers[0][2:-1] == answers[1][:1] + answers[1][2:-1]
    assert (answers[0][-1][2], answers[1][-1][2]) == (b"ab", b"a")
    assert fast == 6 and fast_answers() - before == fast  # all but the read


@pytest.fixture(scope="module")
async def limited_pair(redis_url: str) -> AsyncIterator[tuple[str, str]]:
    """``pair`` with a rate limit on writes; one trusted proxy, so that each test run's
    X-Forwarded-For is a client of its own (a bucket of its own)."""
    async with both_paths(redis_url, **LIMITS, rate_limits="write:=3/m", trusted_proxy_hops=1) as gateways:
        yield gateways


def appended(n: int, field: str, path: str) -> bytes:
    return post(path, b"%d" % n, field)


async def test_the_same_answers_with_rate_limits_on(
    limited_pair: tuple[str, str], http: aiohttp.ClientSession
) -> None:
    answers = []
    before = fast_answers()
    for n, base in enumerate(limited_pair, 1):  # each run a client (a bucket) of its own
        client = f"X-Forwarded-For: 198.51.100.{n}"
        name = f"fp-rl-{uuid.uuid4().hex[:8]}"
        creator = {"Content-Type": "text/plain", "X-Forwarded-For": f"203.0.113.{n}"}
        async with http.put(f"{base}/{name}", headers=creator) as r:
            assert r.status == 201
        answers.append(await answered(base, name, [functools.partial(appended, k, client) for k in range(4)]))
        if base == limited_pair[0]:
            fast = fast_answers() - before
    assert [a[0] for a in answers[0]] == [204, 204, 204, 429]
    assert answers[0][3][1]["retry-after"] in ("19", "20")
    assert answers[0] == answers[1]
    assert fast == 4 and fast_answers() - before == fast


async def test_pipelined_requests_are_answered_in_order(gateway: str, http: aiohttp.ClientSession) -> None:
    a, b = (f"{gateway}/fp-pipe-{uuid.uuid4().hex[:8]}-{n}" for n in "ab")
    async with http.put(a, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    pa, pb = (aiohttp.client.URL(u).path for u in (a, b))
    raw = await Raw.open(gateway)
    before = fast_answers()
    await raw.send(
        post(pa, b"1")
        + request("GET", pa + "?offset=-1")
        + post(pa, b"2")
        + request("PUT", pb, "Content-Type: text/plain", "Content-Length: 0")
        + post(pb, b"3")
        + post(pb, b"4")
        + request("HEAD", pb)
        + post(pa, b"5")
        + request("GET", pa + "?offset=-1")
    )
    statuses, bodies = [], []
    for n in range(9):
        status, _, body = await raw.answer(head_only=n == 6)
        statuses.append(status)
        bodies.append(body)
    await raw.close()
    assert statuses == [204, 200, 204, 201, 204, 204, 200, 204, 200]
    assert bodies[1] == b"1" and bodies[8] == b"125"  # each GET saw exactly the appends before it
    assert fast_answers() - before >= 1  # the first one at least (then aiohttp may still be busy)


async def test_a_connection_comes_back_after_aiohttp_answered(
    gateway: str, http: aiohttp.ClientSession
) -> None:
    url = f"{gateway}/fp-back-{uuid.uuid4().hex[:8]}"
    path = aiohttp.client.URL(url).path
    raw = await Raw.open(gateway)
    await raw.send(request("PUT", path, "Content-Type: text/plain", "Content-Length: 0"))
    assert (await raw.answer())[0] == 201
    before = fast_answers()
    for n in range(50):
        await raw.send(post(path, b"%d," % n))
        assert (await raw.answer())[0] == 204
        if n % 10 == 0:
            await raw.send(request("HEAD", path))
            assert (await raw.answer(head_only=True))[0] == 200
    await raw.close()
    assert fast_answers() - before >= 45  # all but the odd one caught before aiohttp looped
    assert await read_all(http, url) == b"".join(b"%d," % n for n in range(50))


@pytest.mark.parametrize("pause", [0.0, 0.05, 0.8])
async def test_a_body_in_pieces(gateway: str, http: aiohttp.ClientSession, pause: float) -> None:
    url = f"{gateway}/fp-pieces-{uuid.uuid4().hex[:8]}"
    async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    data = post(aiohttp.client.URL(url).path, b"0123456789" * 10)
    raw = await Raw.open(gateway)
    if pause:
        await raw.send(data[:-60])
        await asyncio.sleep(pause)  # its body not all in with its head: aiohttp reads the rest
        await raw.send(data[-60:])
    else:
        for i in range(len(data)):  # a byte at a time
            await raw.send(data[i : i + 1])
    assert (await raw.answer())[0] == 204
    await raw.send(post(aiohttp.client.URL(url).path, b"!"))
    assert (await raw.answer())[0] == 204
    await raw.close()
    assert await read_all(http, url) == b"0123456789" * 10 + b"!"


async def test_chunked_and_obs_fold_are_aiohttps(gateway: str, http: aiohttp.ClientSession) -> None:
    url = f"{gateway}/fp-chunked-{uuid.uuid4().hex[:8]}"
    path = aiohttp.client.URL(url).path
    async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    raw = await Raw.open(gateway)
    chunked = request("POST", path, "Content-Type: text/plain", "Transfer-Encoding: chunked")
    await raw.send(chunked + b"3\r\nabc\r\n0\r\n\r\n" + post(path, b"def"))
    assert [(await raw.answer())[0] for _ in range(2)] == [204, 204]
    await raw.send(
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nX: a\r\n b\r\n\r\n"
    )  # obs-fold
    assert (await raw.answer())[0] == 400  # aiohttp's (llhttp's) answer, as without the fast path
    await raw.close()
    assert await read_all(http, url) == b"abcdef"


async def test_connection_close_is_aiohttps_and_closes(gateway: str, http: aiohttp.ClientSession) -> None:
    url = f"{gateway}/fp-close-{uuid.uuid4().hex[:8]}"
    async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    raw = await Raw.open(gateway)
    await raw.send(post(aiohttp.client.URL(url).path, b"x", "Connection: close"))
    assert (await raw.answer())[0] == 204
    assert await asyncio.wait_for(raw.reader.read(), 5) == b""  # then the server closed it
    await raw.close()


async def test_an_append_whose_client_left_still_counts_once(
    gateway: str, http: aiohttp.ClientSession
) -> None:
    url = f"{gateway}/fp-left-{uuid.uuid4().hex[:8]}"
    async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    for n in range(20):
        raw = await Raw.open(gateway)
        await raw.send(post(aiohttp.client.URL(url).path, b"%d;" % n))
        raw.writer.transport.abort()  # gone before the answer
    for _ in range(100):
        body = await read_all(http, url)
        if body.count(b";") == 20:
            break
        await asyncio.sleep(0.05)
    assert sorted(body.split(b";")[:-1], key=int) == [b"%d" % n for n in range(20)]


async def test_bytes_that_cannot_begin_a_request_are_refused_at_once(
    gateway: str, http: aiohttp.ClientSession
) -> None:
    """A body longer than its Content-Length, in one write: llhttp refuses the connection's
    bytes at once (aiohttp's 400, the connection closed), not held until the keep-alive
    timeout as the start of a head; and, as on aiohttp's path, the append framed before the
    error in the same read is neither answered nor stored (it reached no door)."""
    url = f"{gateway}/fp-garbage-{uuid.uuid4().hex[:8]}"
    async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    for rest in (b"def", b"OK"):
        raw = await Raw.open(gateway)
        await raw.send(post(aiohttp.client.URL(url).path, b"abc") + rest)
        assert (await raw.answer())[0] == 400  # (Raw.answer waits 10 s at most)
        assert await asyncio.wait_for(raw.reader.read(), 5) == b""
        await raw.close()
        raw = await Raw.open(gateway)  # the same bytes in two writes: the first answered, then 400
        await raw.send(post(aiohttp.client.URL(url).path, b"abc"))
        assert (await raw.answer())[0] == 204
        await raw.send(rest + b"\r\n\r\n")
        assert (await raw.answer())[0] == 400
        assert await asyncio.wait_for(raw.reader.read(), 5) == b""
        await raw.close()
    assert await read_all(http, url) == b"abcabc"
