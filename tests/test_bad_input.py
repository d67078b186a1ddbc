"""One bad request gets a clear 4xx, stores nothing, and never hurts another request.

Raw sockets where a client library would refuse to send the input (bytes that
are not UTF-8 in headers, a Host with a bad port).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import uuid

import pytest

from gateway.redis_io import keys

from .conftest import read_all, serving

TEXT = {"Content-Type": "text/plain"}


def raw_request(
    base: str, method: str, path: str, headers: list[tuple[str, bytes]], body: bytes = b""
) -> int:
    """Send bytes as they are; the status code of the answer."""
    host, port = base.split("//", 1)[1].split("/", 1)[0].split(":")
    lines = [
        f"{method} {path} HTTP/1.1".encode(),
        b"Connection: close",
        f"Content-Length: {len(body)}".encode(),
    ]
    if not any(name.lower() == "host" for name, _ in headers):
        lines.append(f"Host: {host}:{port}".encode())
    lines += [name.encode() + b": " + value for name, value in headers]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        answer = b""
        while b"\r\n" not in answer:
            piece = s.recv(4096)
            if not piece:
                break
            answer += piece
    return int(answer.split(b" ", 2)[1])


def path_of(url: str) -> str:
    return "/" + url.split("//", 1)[1].split("/", 1)[1]


BAD_PUTS = [
    ("expires year 1", [("Stream-Expires-At", b"0001-01-01T00:00:00+01:00")]),
    ("expires year 9999", [("Stream-Expires-At", b"9999-12-31T23:59:59-01:00")]),
    ("expires other digits", [("Stream-Expires-At", "٢٠٢٦-01-01T00:00:00Z".encode())]),
    ("content type not UTF-8", [("Content-Type", b"text/plain; charset=\xff")]),
    ("content type not ASCII", [("Content-Type", "text/plain; charset=é".encode())]),
    ("forked from not UTF-8", [("Stream-Forked-From", b"/v1/stream/\xff")]),
    ("bad Host port", [("Host", b"example.com:99999")]),
    ("gzip that is not", [("Content-Type", b"text/plain"), ("Content-Encoding", b"gzip")]),
    ("unknown encoding", [("Content-Type", b"text/plain"), ("Content-Encoding", b"br")]),
]


@pytest.mark.parametrize("name, headers", BAD_PUTS, ids=[n for n, _ in BAD_PUTS])
async def test_bad_create_is_4xx_and_creates_nothing(gateway, http, name, headers) -> None:
    url = f"{gateway}/bad-{uuid.uuid4().hex[:8]}"
    status = await asyncio.to_thread(raw_request, gateway, "PUT", path_of(url), headers, b"not gzip")
    assert 400 <= status < 500, f"{name}: {status}"
    async with http.head(url) as r:
        assert r.status == 404, f"{name}: a stream was created"


BAD_JSON = [
    ("nested 1000 deep", b"[" * 1000 + b"]" * 1000),
    ("nested 300 deep", b"[" * 300 + b"]" * 300),
    ("nested deep with long digits", b"[" * 600 + b"12345678901234567890123" + b"]" * 600),
    ("lone surrogate", b'"\\ud800"'),
    ("lone surrogate with long digits", b'["\\ud800", 12345678901234567890123]'),
    ("infinite number", b"1e400"),
    ("infinite number with long digits", b"[1e400, 12345678901234567890123]"),
    ("NaN", b"[NaN]"),
]


@pytest.mark.parametrize("name, body", BAD_JSON, ids=[n for n, _ in BAD_JSON])
async def test_bad_json_is_400_and_stores_nothing(http, url, name, body) -> None:
    async with http.put(url, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 201
    async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400, f"{name}: {r.status} {await r.text()}"
    async with http.get(url, params={"offset": "-1"}) as r:
        assert await r.read() == b"[]"


async def test_big_integers_are_kept_exactly_and_deep_json_within_the_limit_is_stored(http, url) -> None:
    async with http.put(url, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 201
    deep = b"[" * 253 + b"1" + b"]" * 253
    for body in (b"[12345678901234567890123, 1.5]", deep):
        async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 204
    assert await read_all(http, url) == b"[12345678901234567890123,1.5," + deep[1:-1] + b"]"


async def test_json_messages_are_capped_only_when_asked(redis_url, http) -> None:
    # No cap by default (a body is stored in bounded entries, tests/test_bounds.py); an
    # operator may still set --max-json-messages: a larger array is refused whole.
    async with serving(redis_url, max_json_messages=1000) as base:
        url = f"{base}/capped-{uuid.uuid4().hex[:8]}"
        async with http.put(url, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 201
        async with http.post(url, data=b"[" + b",".join([b"1"] * 1001) + b"]",
                             headers={"Content-Type": "application/json"}) as r:  # fmt: skip
            assert r.status == 413
        async with http.post(url, data=b"[" + b",".join([b"1"] * 1000) + b"]",
                             headers={"Content-Type": "application/json"}) as r:  # fmt: skip
            assert r.status == 204
        async with http.get(url, params={"offset": "-1"}) as r:
            assert await r.json() == [1] * 1000


async def test_compressed_bodies_are_inflated_within_the_limit(http, url) -> None:
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 201
    async with http.post(
        url, data=gzip.compress(b"hello"), headers={**TEXT, "Content-Encoding": "gzip"}
    ) as r:
        assert r.status == 204
    bomb = gzip.compress(b"\0" * 10_000_000)  # the session gateway takes 4096 bytes
    async with http.post(url, data=bomb, headers={**TEXT, "Content-Encoding": "gzip"}) as r:
        assert r.status == 413
    async with http.post(
        url, data=gzip.compress(b"x")[:-4], headers={**TEXT, "Content-Encoding": "gzip"}
    ) as r:
        assert r.status == 400  # truncated
    async with http.get(url, params={"offset": "-1"}) as r:
        assert await r.read() == b"hello"


async def test_a_transfer_coding_other_than_chunked_is_400_and_stores_nothing(gateway, http, url) -> None:
    """aiohttp takes the chunked framing off a body and would leave gzip (or any other
    transfer coding) on the bytes stored; chunked alone is a body like any other."""
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 201
    chunked = b"%x\r\n%b\r\n0\r\n\r\n"
    zipped = gzip.compress(b"hello")
    cases = [
        (b"gzip, chunked", chunked % (len(zipped), zipped)),
        (b"Chunked", chunked % (2, b"ok")),
        (b", chunked", chunked % (1, b"!")),  # an empty list element is nothing (RFC 9110, 5.6.1)
    ]
    host, port = gateway.split("//", 1)[1].split("/", 1)[0].split(":")
    statuses = []
    for coding, body in cases:
        reader, writer = await asyncio.open_connection(host, int(port))
        head = f"POST {path_of(url)} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: text/plain\r\n"
        writer.write(head.encode() + b"Transfer-Encoding: " + coding + b"\r\n\r\n" + body)
        statuses.append(int((await asyncio.wait_for(reader.readline(), 10)).split()[1]))
        writer.close()
    assert statuses == [400, 204, 204]
    async with http.get(url, params={"offset": "-1"}) as r:
        assert await r.read() == b"ok!"


BAD_APPEND_HEADERS = [
    [("Stream-Seq", b"\xff")],
    [("Producer-Id", b"\xff\xfe"), ("Producer-Epoch", b"0"), ("Producer-Seq", b"0")],
    [("Stream-Seq", b"a\x01b")],
    [("Content-Type", b"text/plain; x=\xff")],
]


async def test_bad_appends_never_fail_their_neighbours(gateway, http, caplog) -> None:
    """Appends are group-committed across streams: 200 bad requests arriving among
    good ones must fail alone (they used to fail whole batches with 500)."""
    good = [f"{gateway}/good-{uuid.uuid4().hex[:8]}-{n}" for n in range(8)]
    bad = f"{gateway}/bad-{uuid.uuid4().hex[:8]}"
    for url in (*good, bad):
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 201

    async def good_writer(url: str) -> list[int]:
        statuses = []
        for i in range(40):
            async with http.post(url, data=f"{i};".encode(), headers=TEXT) as r:
                statuses.append(r.status)
        return statuses

    def bad_writer(n: int) -> list[int]:
        return [
            raw_request(gateway, "POST", path_of(bad), [("Content-Type", b"text/plain"), *h], b"bad")
            for _ in range(n)
            for h in BAD_APPEND_HEADERS
        ]

    with caplog.at_level(logging.INFO):
        results = await asyncio.gather(
            *(good_writer(url) for url in good), *(asyncio.to_thread(bad_writer, 10) for _ in range(5))
        )
    for statuses in results[: len(good)]:
        assert statuses == [204] * 40
    for statuses in results[len(good) :]:
        assert all(s == 400 for s in statuses), statuses
    for url in good:
        assert await read_all(http, url) == b"".join(f"{i};".encode() for i in range(40))
    assert await read_all(http, bad) == b""
    # Bad input is the client's business: no error lines, no tracebacks in the log.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def test_a_failing_append_in_a_batch_fails_alone(gateway, http, redis) -> None:
    """A script error in one append (here: a corrupt producer key) must not undo, hide
    or fail the other appends of its batch: each client learns its own outcome."""
    base = f"{gateway}/batch-{uuid.uuid4().hex[:8]}"
    streams = [f"{base}-{n}" for n in range(6)]
    for url in streams:
        async with http.put(url, headers=TEXT) as r:
            assert r.status == 201
    broken = streams[3]
    await redis.set(keys.stream_keys(keys.stream_id(path_of(broken).split("/v1/stream/", 1)[1]))[2], "x")

    async def post(url: str, headers: dict) -> int:
        async with http.post(url, data=b"data", headers={**TEXT, **headers}) as r:
            return r.status

    producer = {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
    # Pause writes so every append queues behind the first: they go in batches together.
    await redis.execute_command("CLIENT", "PAUSE", "300", "WRITE")
    statuses = await asyncio.gather(
        *(post(url, producer) for url in streams), *(post(url, {}) for url in streams)
    )
    broken_index = streams.index(broken)
    for i, status in enumerate(statuses):
        if i == broken_index:  # the producer append on the corrupt key
            assert status == 500
        else:
            assert status in (200, 204), (i, status)
    for url in streams:
        async with http.get(url, params={"offset": "-1"}) as r:
            assert await r.read() == (b"data" if url == broken else b"datadata")
