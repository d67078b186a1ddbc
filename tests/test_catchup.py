"""Catch-up reads answered whole, streamed (issue 41).

The rules first (no Redis): content-coding negotiation, which types are compressed, a
compressed answer's ETag, JSON pages of grouped messages, the read budget. Then the
referee: over random stream shapes (bytes, text and JSON with State events; forks;
archived parts), one answer streamed in pages of 1 KiB is byte for byte the
concatenation of the small answers it replaces (a gateway whose --max-chunk-bytes is
tiny), from -1 and from every offset those answers name, compressed or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
import zlib

import aiohttp
import brotli
import orjson
import pytest
import zstandard

from gateway.archive.files import Archive
from gateway.concurrency.budget import ByteBudget
from gateway.protocol import caching
from gateway.protocol.encodings import compressible, negotiate
from gateway.protocol.entries import end_of, messages_between
from gateway.protocol.jsonmode import json_items
from gateway.redis_io import keys
from workers.archiver import Archiver

from .conftest import start_gateway
from .test_archive import HOT0, sid_of

OFFERED = ("zstd", "br", "gzip")


@pytest.mark.parametrize(
    "header,expected",
    [
        (None, ""),
        ("", ""),
        ("identity", ""),
        ("gzip", "gzip"),
        ("gzip, deflate", "gzip"),
        ("gzip, deflate, br", "br"),  # undici over https
        ("gzip, deflate, br, zstd", "zstd"),  # Chromium
        ("GZIP;q=0.5, br;q=0.9", "br"),
        ("zstd;q=0, gzip", "gzip"),
        ("*", "zstd"),
        ("*;q=0.1, zstd;q=0", "br"),
        ("gzip;q=0", ""),
        ("gzip;q=abc", ""),
        ("gzip;q=2", ""),
        ("deflate, compress", ""),
        (",,; q=1, ;", ""),
    ],
)
def test_negotiate(header: str | None, expected: str) -> None:
    assert negotiate(header, OFFERED) == expected
    assert negotiate(header, ()) == ""


def test_negotiate_follows_the_servers_order_on_ties() -> None:
    assert negotiate("gzip, zstd, br", ("gzip", "zstd")) == "gzip"
    assert negotiate("gzip, zstd;q=1.0", ("zstd", "gzip")) == "zstd"


@pytest.mark.parametrize(
    "media,expected",
    [
        ("application/json", True),
        ("text/plain", True),
        ("text/csv", True),
        ("application/ld+json", True),
        ("application/x-ndjson", True),
        ("image/svg+xml", True),
        ("application/octet-stream", False),
        ("application/gzip", False),
        ("application/zstd", False),
        ("image/png", False),
        ("video/mp4", False),
        ("application/protobuf", False),
    ],
)
def test_only_textual_types_are_compressed(media: str, expected: bool) -> None:
    assert compressible(media) is expected


def test_a_compressed_answer_has_its_own_etag_naming_the_same_state() -> None:
    plain = caching.etag("s", "123", 0, 10, False)
    gzip = caching.etag("s", "123", 0, 10, False, "gzip")
    assert gzip != plain and gzip.endswith('+gzip"')
    assert caching.named_state(gzip[1:-1], "s") == caching.named_state(plain[1:-1], "s")
    assert caching.incarnation(gzip) == "123"
    assert caching.matches(gzip, gzip) and not caching.matches(plain, gzip)


def test_json_items_of_grouped_and_single_messages() -> None:
    change = b'{"type":"t","key":"k","value":1,"headers":{"operation":"insert"}}'
    group = b"1\n" + change + b'\n"x"'
    assert end_of(10, group, True) == 10 + 1 + len(change) + 3
    assert end_of(10, group, False) == 10 + len(group)
    items = json_items([(10, group), (100, b"[2]")])
    values = orjson.loads(b"[" + items + b"]")
    assert values[0] == 1 and values[2] == "x" and values[3] == [2]
    assert values[1]["headers"]["offset"].endswith(str(2 * (11 + len(change))).zfill(16))
    assert messages_between(10, group, 11, 11 + len(change)) == (11, change)
    assert messages_between(10, group, 12, 100) == (11 + len(change), b'"x"')
    assert messages_between(10, group, 0, 10) is None


async def test_the_read_budget_waits_in_turn_and_forgets_the_cancelled() -> None:
    budget = ByteBudget(10)
    assert await budget.take(50) == 10  # more than the whole: clamped
    budget.give(10)
    assert await budget.take(6) == 6
    first = asyncio.ensure_future(budget.take(8))
    second = asyncio.ensure_future(budget.take(1))
    await asyncio.sleep(0)
    assert not first.done() and not second.done()  # 6 held; 1 would fit, but first come, first served
    second.cancel()
    await asyncio.sleep(0)
    budget.give(6)
    assert await first == 8 and budget.held == 8
    budget.give(8)
    assert budget.held == 0 and not budget._waiters


# -- the referee ----------------------------------------------------------------------

KINDS = {
    "bytes": "application/octet-stream",
    "text": "text/plain; charset=utf-8",
    "json": "application/json",
}


def _bodies(rng: random.Random, kind: str, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        if kind == "json":
            messages: list[object] = []
            for _ in range(rng.choice([1, 1, 3, 40, 300])):
                if rng.random() < 0.2:
                    k = rng.randrange(20)
                    messages.append({"type": "row", "key": f"k{k}", "value": {"v": rng.random()},
                                     "headers": {"operation": rng.choice(["insert", "update"])}})  # fmt: skip
                else:
                    messages.append({"n": rng.randrange(10**6), "s": "é" * rng.randrange(40)})
            out.append(orjson.dumps(messages if len(messages) > 1 else messages[0]))
        else:
            size = rng.choice([1, 7, 100, 3000, 20_000, 70_000])
            text = "".join(rng.choice("aé€😀\n") for _ in range(min(size, 500)))
            raw = text.encode() * (size // max(len(text.encode()), 1) + 1)
            out.append(raw[:size] if kind == "bytes" else raw.decode(errors="ignore").encode())
    return [b for b in out if b]


async def _small_answers(http: aiohttp.ClientSession, url: str, offset: str) -> list[tuple[str, bytes]]:
    """(the offset asked, the body) of each small answer from ``offset`` to the tail."""
    out = []
    for _ in range(100_000):
        async with http.get(url, params={"offset": offset}, headers={"Accept-Encoding": "identity"}) as r:
            assert r.status == 200, await r.text()
            out.append((offset, await r.read()))
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                return out
    raise AssertionError("never up to date")


def _joined(kind: str, bodies: list[bytes]) -> bytes:
    if kind != "json":
        return b"".join(bodies)
    inner = [b[1:-1] for b in bodies if b != b"[]"]
    return b"[" + b",".join(inner) + b"]"


def _decoded(coding: str | None, data: bytes) -> bytes:
    if coding == "gzip":
        return zlib.decompress(data, 16 + zlib.MAX_WBITS)
    if coding == "br":
        return brotli.decompress(data)
    if coding == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    assert coding is None
    return data


async def _check(http, small: str, big: str, kind: str, rng: random.Random) -> int:
    answers = await _small_answers(http, small, "-1")
    starts = list(range(len(answers)))
    rng.shuffle(starts)
    for i in [0, *starts[:6]]:
        offset = answers[i][0]
        expected = _joined(kind, [body for _, body in answers[i:]])
        coding = rng.choice(["identity", "gzip", "br", "zstd"])
        asked = {"Accept-Encoding": coding}
        async with http.get(big, params={"offset": offset}, headers=asked, auto_decompress=False) as r:
            assert r.status == 200
            body = _decoded(r.headers.get("Content-Encoding"), await r.read())
            assert r.headers.get("Stream-Up-To-Date") == "true"
            if kind == "bytes":
                assert r.headers.get("Content-Encoding") is None  # never for opaque bytes
        assert body == expected, f"from {offset}: {len(body)} bytes, expected {len(expected)}"
    return len(answers)


@pytest.mark.parametrize("seed", range(6))
async def test_one_answer_is_the_small_answers_joined(redis_url, redis, http, archive_dir, seed: int) -> None:
    rng = random.Random(seed)
    kind = ["bytes", "json", "text"][seed % 3]
    cap = rng.choice([300, 4000, 30_000])
    small = await start_gateway(redis_url, max_chunk_bytes=cap, archive_url=archive_dir)
    big = await start_gateway(
        redis_url, read_page_bytes=1024, read_inline_bytes=rng.choice([16, 65536]), archive_url=archive_dir,
        compression_min_bytes=0,
    )  # fmt: skip
    try:
        name = f"whole-{seed}-{uuid.uuid4().hex[:6]}"
        s_url, b_url = (str(g.make_url(f"/v1/stream/{name}")) for g in (small, big))
        headers = {"Content-Type": KINDS[kind]}
        async with http.put(s_url, headers=headers) as r:
            assert r.status == 201
        for body in _bodies(rng, kind, rng.randrange(5, 25)):
            async with http.post(s_url, data=body, headers=headers) as r:
                assert r.status in (200, 204), await r.text()
        pieces = await _check(http, s_url, b_url, kind, rng)
        # A fork from one of the small answers' offsets, with data of its own.
        answers = await _small_answers(http, s_url, "-1")
        fork_at = answers[rng.randrange(len(answers))][0]
        fork = {**headers, "Stream-Forked-From": name, "Stream-Fork-Offset": fork_at}
        if fork_at == "-1":
            del fork["Stream-Fork-Offset"]
        async with http.put(s_url + "-fork", headers=fork) as r:
            assert r.status == 201, await r.text()
        for body in _bodies(rng, kind, 4):
            async with http.post(s_url + "-fork", data=body, headers=headers) as r:
                assert r.status in (200, 204)
        await _check(http, s_url + "-fork", b_url + "-fork", kind, rng)
        # Part of the source archived (cold, then hot), then all of it.
        archive = Archive(archive_dir)
        tail = int(await redis.hget(keys.stream_keys(sid_of(s_url))[0], "tail"))
        for hot_bytes in (tail // 2, 0):
            policy = dataclasses.replace(HOT0, hot_bytes=hot_bytes)
            await Archiver(redis, archive, policy).archive_stream(sid_of(s_url))
            await _check(http, s_url, b_url, kind, rng)
            await _check(http, s_url + "-fork", b_url + "-fork", kind, rng)
        print(f"seed {seed}: {kind}, {pieces} small answers of at most {cap} bytes")
    finally:
        await small.close()
        await big.close()
