"""A battery of malformed requests, sent raw, concurrently with legitimate appends.

Each bad request goes over a plain socket (``rawhttp``), byte for byte, so
what a client library would refuse to send (bytes that are not UTF-8 in
headers, a Host with a bad port, bare CR/LF, conflicting lengths) really
reaches the server. Rules:

* a **strict** case must be answered 4xx within its time bound (never 5xx,
  never a hang), and must store nothing: its own victim stream (created with
  known content beforehand) is unchanged afterwards (content, tail, closed
  state), and a stream it tried to create does not exist;
* a **tolerated** case is valid, or arguably valid, input that a server may
  accept (a far-future expiry, a 30-digit JSON integer, a GET with a body):
  never 5xx, never a hang; if refused (4xx) it stores nothing, and if accepted
  it must keep exactly what was sent (checked per case);
* no response carries a header smuggled in by the request.

Meanwhile writers append to streams in every append lane (appends are
group-committed in batches across streams): every one of those appends must
succeed, and each stream holds exactly them, in order. One bad request must
never fail another.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import random
import time
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from gateway.cli.embedded import find_redis_server

from . import harness, rawhttp
from .conftest import Summary
from .history import Append, check_stream
from .workload import PREFIX, Clock, Stats, Timing, post_record, read_all

P = PREFIX
OFFSET0 = "0000000000000000_0000000000000000"
BIG = "123456789012345678901234567890"
LONG_DIGITS = "1234567890123456789012"  # 22 digits: another JSON parser path in some servers
MAX_BODY = 64 * 1024


@dataclass
class Ctx:
    """What a case's request is about: its victim stream and a name for a stream to create."""

    victim: str  # exists, with known content
    fresh: str  # does not exist
    port: int


Build = Callable[[Ctx], bytes]
Accept = Callable[[Ctx, rawhttp.RawResponse, "Battery"], list[str]]


@dataclass
class Case:
    name: str
    build: Build
    strict: bool = True  # must be 4xx
    json: bool = False  # the victim is an application/json stream
    timeout: float = 10.0
    repeat: int = 1  # sent this many times (appends: to land in batches with legitimate ones)
    on_accept: Accept | None = None  # a tolerated case answered 2xx: what must hold then
    note: str = ""


# Headers every battery request carries: with access control on, a valid admin token,
# so each bad request gets past the credentials check to the checks it is about.
CREDENTIALS: list[tuple[str, str]] = []
TOKEN = "battery-admin-token-0123456789"


def req(method: str, path: bytes | str, headers=(), body: bytes = b"", **kw) -> bytes:  # type: ignore[no-untyped-def]
    return rawhttp.build(method, path, [*CREDENTIALS, *headers], body, **kw)


def post(ctx: Ctx, headers, body: bytes = b"x;", ct: bytes | str = "text/plain") -> bytes:  # type: ignore[no-untyped-def]
    return req("POST", P + ctx.victim, [("Content-Type", ct), *headers], body)


def put_fresh(ctx: Ctx, headers, body: bytes = b"", **kw) -> bytes:  # type: ignore[no-untyped-def]
    return req("PUT", P + ctx.fresh, list(headers), body, **kw)


def post_json(ctx: Ctx, body: bytes, headers=()) -> bytes:  # type: ignore[no-untyped-def]
    return req("POST", P + ctx.victim, [("Content-Type", "application/json"), *headers], body)


def get(ctx: Ctx, query: str) -> bytes:
    return req("GET", f"{P}{ctx.victim}?{query}")


def fork(ctx: Ctx, headers) -> bytes:  # type: ignore[no-untyped-def]
    return put_fresh(ctx, [("Stream-Forked-From", f"{P}{ctx.victim}"), *headers])


def expires(value: str) -> Build:
    return lambda ctx: put_fresh(ctx, [("Content-Type", "text/plain"), ("Stream-Expires-At", value)])


def fresh_answers_below_500(ctx: Ctx, response: rawhttp.RawResponse, battery: Battery) -> list[str]:
    status = battery.head_status(ctx.fresh)
    return [] if status < 500 else [f"HEAD of the stream it created answered {status}"]


def dot_dot_readable(ctx: Ctx, response: rawhttp.RawResponse, battery: Battery) -> list[str]:
    """A stream created at a path with dot segments must be there at that same path."""
    r = battery.raw(req("HEAD", P + "../../etc/" + ctx.fresh))
    return [] if r.status == 200 else [f"HEAD of the same path answers {r.status}"]


def json_kept_exactly(literal: str) -> Accept:
    """An accepted JSON append must read back as exactly the value sent."""

    def check(ctx: Ctx, response: rawhttp.RawResponse, battery: Battery) -> list[str]:
        body = battery.read(ctx.victim)
        if literal.encode() not in body:
            return [f"accepted {literal[:60]!r} but the stream reads {body[-200:]!r}: the value was changed"]
        return []

    return check


@functools.cache
def gzip_bomb(inflated: int) -> bytes:
    """A small gzip body that inflates to ``inflated`` bytes (far past --max-body-bytes)."""
    return gzip.compress(b"\0" * inflated, 9)


@functools.cache
def json_bomb(elements: int) -> bytes:
    return gzip.compress(b"[" + b"1," * elements + b"1]", 9)


def deep(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


CASES: list[Case] = [
    # -- a browser page of a foreign origin writing (a simple POST needs no preflight) --
    Case("foreign-origin-post", lambda c: post(c, [("Origin", "https://evil.example")]), repeat=5),
    Case("foreign-origin-delete", lambda c: req("DELETE", P + c.victim, [("Origin", "null")])),
    # -- non-ASCII and non-UTF-8 bytes in protocol headers (appends: batched with others) --
    Case("stream-seq-not-utf8", lambda c: post(c, [(b"Stream-Seq", b"\xff\xfe")]), repeat=10),
    Case("stream-seq-latin1", lambda c: post(c, [(b"Stream-Seq", b"caf\xe9")]), repeat=10),
    Case("stream-seq-utf8-non-ascii", lambda c: post(c, [("Stream-Seq", "séq-☃".encode())]), repeat=10),
    Case(
        "producer-id-not-utf8",
        lambda c: post(c, [(b"Producer-Id", b"p\xff"), ("Producer-Epoch", "0"), ("Producer-Seq", "0")]),
        repeat=10,
    ),
    Case(
        "producer-id-utf8-non-ascii",
        lambda c: post(
            c, [("Producer-Id", "prodé".encode()), ("Producer-Epoch", "0"), ("Producer-Seq", "0")]
        ),
        repeat=10,
    ),
    Case(
        "producer-seq-fullwidth-digit",
        lambda c: post(c, [("Producer-Id", "p"), ("Producer-Epoch", "0"), ("Producer-Seq", "１".encode())]),
    ),
    Case(
        "content-type-param-not-utf8-post", lambda c: post(c, [], ct=b"text/plain; charset=\xff"), repeat=10
    ),
    Case(
        "content-type-param-not-utf8-put", lambda c: put_fresh(c, [(b"Content-Type", b"text/plain; x=\xff")])
    ),
    Case(
        "content-type-param-utf8-put", lambda c: put_fresh(c, [("Content-Type", "text/plain; x=é".encode())])
    ),
    Case("content-type-type-not-ascii", lambda c: put_fresh(c, [("Content-Type", "téxt/plain".encode())])),
    Case(
        "forked-from-not-utf8",
        lambda c: put_fresh(c, [(b"Stream-Forked-From", (P + c.victim).encode() + b"\xff")]),
    ),
    Case("forked-from-utf8", lambda c: put_fresh(c, [("Stream-Forked-From", (P + c.victim + "é").encode())])),
    Case("forked-from-pct-ff", lambda c: put_fresh(c, [("Stream-Forked-From", P + c.victim + "%ff")])),
    Case(
        "forked-from-pct-crlf",
        lambda c: put_fresh(c, [("Stream-Forked-From", P + c.victim + "%0d%0aX-Evil:%201")]),
    ),
    Case("stream-ttl-fullwidth", lambda c: put_fresh(c, [("Stream-TTL", "３６００".encode())])),
    # -- expiry --
    Case("expires-0001+23:59-before-year-1", expires("0001-01-01T00:00:00+23:59")),
    Case("expires-9999-23:59-after-year-9999", expires("9999-12-31T23:59:59-23:59")),
    Case("expires-year-0000", expires("0000-01-01T00:00:00Z")),
    Case("expires-offset-99:99", expires("2030-01-01T00:00:00+99:99")),
    Case("expires-month-13", expires("2030-13-01T00:00:00Z")),
    Case(
        "expires-fullwidth-digits",
        lambda c: put_fresh(c, [("Stream-Expires-At", "２０３０-01-01T00:00:00Z".encode())]),
    ),
    Case(
        "expires-0001Z-in-the-past",
        expires("0001-01-01T00:00:00Z"),
        strict=False,
        on_accept=fresh_answers_below_500,
    ),  # fmt: skip
    Case(
        "expires-0001-23:59",
        expires("0001-01-01T00:00:00-23:59"),
        strict=False,
        on_accept=fresh_answers_below_500,
    ),  # fmt: skip
    Case("expires-9999Z", expires("9999-12-31T23:59:59Z"), strict=False, on_accept=fresh_answers_below_500),
    Case(
        "expires-9999+23:59",
        expires("9999-12-31T23:59:59+23:59"),
        strict=False,
        on_accept=fresh_answers_below_500,
    ),  # fmt: skip
    Case(
        "expires-long-fraction",
        expires("2030-01-01T00:00:00." + "9" * 200 + "Z"),
        strict=False,
        on_accept=fresh_answers_below_500,
    ),  # fmt: skip
    Case("stream-ttl-huge", lambda c: put_fresh(c, [("Stream-TTL", "9" * 40)])),
    Case("stream-ttl-2^64", lambda c: put_fresh(c, [("Stream-TTL", str(2**64))])),
    Case(
        "stream-ttl-and-expires",
        lambda c: put_fresh(c, [("Stream-TTL", "60"), ("Stream-Expires-At", "2030-01-01T00:00:00Z")]),
    ),  # fmt: skip
    # -- JSON bodies --
    Case("json-nested-1000", lambda c: post_json(c, deep(1000)), json=True, repeat=3),
    Case("json-nested-1000-put", lambda c: put_fresh(c, [("Content-Type", "application/json")], deep(1000))),
    Case("json-nested-100000", lambda c: post_json(c, deep(100_000)), json=True),
    Case("json-nested-5000-long-digits", lambda c: post_json(c, deep(5000, LONG_DIGITS.encode())), json=True),
    Case("json-lone-surrogate", lambda c: post_json(c, b'"\\ud800"'), json=True, repeat=3),
    Case(
        "json-lone-surrogate-long-digits",
        lambda c: post_json(c, f'["\\ud800", {LONG_DIGITS}]'.encode()),
        json=True,
        repeat=3,
    ),  # fmt: skip
    Case("json-1e400", lambda c: post_json(c, b"1e400"), json=True),
    Case(
        "json-1e400-long-digits",
        lambda c: post_json(c, f"[1e400, {LONG_DIGITS}]".encode()),
        json=True,
        repeat=3,
    ),
    Case("json-nan-long-digits", lambda c: post_json(c, f"[NaN, {LONG_DIGITS}]".encode()), json=True),
    Case("json-not-utf8", lambda c: post_json(c, b'"\xff\xfe"'), json=True),
    Case("json-empty-array", lambda c: post_json(c, b"[]"), json=True),
    Case(
        "json-invalid-with-close",
        lambda c: post_json(c, b"{nope", [("Stream-Closed", "true")]),
        json=True,
        note="must not close the stream either",
    ),  # fmt: skip
    Case(
        "json-bigint",
        lambda c: post_json(c, BIG.encode()),
        json=True,
        strict=False,
        on_accept=json_kept_exactly(BIG),
    ),  # fmt: skip
    # -- content encodings --
    Case("gzip-not-gzip", lambda c: post(c, [("Content-Encoding", "gzip")], b"this is not gzip"), repeat=3),
    Case("deflate-not-deflate", lambda c: post(c, [("Content-Encoding", "deflate")], b"this is not deflate")),
    Case(
        "gzip-truncated", lambda c: post(c, [("Content-Encoding", "gzip")], gzip.compress(b"x;" * 1000)[:30])
    ),
    Case(
        "gzip-bomb-post", lambda c: post(c, [("Content-Encoding", "gzip")], gzip_bomb(64 << 20)), timeout=20
    ),
    Case(
        "gzip-bomb-put",
        lambda c: put_fresh(
            c, [("Content-Type", "text/plain"), ("Content-Encoding", "gzip")], gzip_bomb(64 << 20)
        ),
        timeout=20,
    ),  # fmt: skip
    Case(
        "gzip-bomb-json",
        lambda c: post_json(c, json_bomb(16 << 20), [("Content-Encoding", "gzip")]),
        json=True,
        timeout=20,
    ),  # fmt: skip
    Case("unknown-encoding", lambda c: post(c, [("Content-Encoding", "x-unknown")], b"x;"), strict=False),
    # -- Host --
    Case(
        "host-port-99999", lambda c: put_fresh(c, [("Content-Type", "text/plain")], host=b"example.com:99999")
    ),
    Case("host-unclosed-bracket", lambda c: put_fresh(c, [("Content-Type", "text/plain")], host=b"[::1")),
    Case("host-not-utf8", lambda c: put_fresh(c, [("Content-Type", "text/plain")], host=b"ex\xffample.com")),
    Case(
        "host-port-letters",
        lambda c: put_fresh(c, [("Content-Type", "text/plain")], host=b"example.com:http"),
    ),
    Case(
        "host-with-path", lambda c: put_fresh(c, [("Content-Type", "text/plain")], host=b"example.com/evil")
    ),
    # -- forks --
    Case(
        "fork-sub-offset-huge",
        lambda c: fork(c, [("Stream-Fork-Offset", OFFSET0), ("Stream-Fork-Sub-Offset", "9" * 40)]),
    ),  # fmt: skip
    Case(
        "fork-sub-offset-2^64",
        lambda c: fork(c, [("Stream-Fork-Offset", OFFSET0), ("Stream-Fork-Sub-Offset", str(2**64))]),
    ),  # fmt: skip
    Case("fork-sub-offset-without-offset", lambda c: fork(c, [("Stream-Fork-Sub-Offset", "1")])),
    Case("fork-offset-malformed", lambda c: fork(c, [("Stream-Fork-Offset", "zz")])),
    Case(
        "fork-offset-beyond-tail",
        lambda c: fork(c, [("Stream-Fork-Offset", "0000000000000000_9999999999999999")]),
    ),
    Case("fork-offset-not-utf8", lambda c: fork(c, [(b"Stream-Fork-Offset", b"0000000000000000_\xff")])),
    Case(
        "fork-of-missing-stream", lambda c: put_fresh(c, [("Stream-Forked-From", P + "no-such-" + c.fresh)])
    ),
    # -- offsets, cursors, live modes --
    Case("offset-garbage", lambda c: get(c, "offset=abc")),
    Case("offset-300-digits", lambda c: get(c, "offset=" + "9" * 300)),
    Case("offset-negative", lambda c: get(c, "offset=-2")),
    Case("offset-pct-ff", lambda c: get(c, "offset=%ff")),
    Case("offset-fullwidth", lambda c: get(c, "offset=%EF%BC%90")),
    Case("offset-twice", lambda c: get(c, "offset=-1&offset=-1")),
    Case("offset-crlf", lambda c: get(c, "offset=%0d%0aX-Evil:%201")),
    Case(
        "offset-max-position-sse",
        lambda c: get(c, "offset=0000000000000000_9999999999999999&live=sse"),
        strict=False,
    ),  # fmt: skip
    Case(
        "offset-other-generation", lambda c: get(c, "offset=0000000000000001_0000000000000000"), strict=False
    ),
    Case("cursor-garbage", lambda c: get(c, "offset=-1&live=long-poll&cursor=abc")),
    Case("cursor-30-digits", lambda c: get(c, "offset=-1&live=long-poll&cursor=" + "9" * 30)),
    Case("cursor-negative", lambda c: get(c, "offset=-1&live=long-poll&cursor=-5")),
    Case("live-bogus", lambda c: get(c, "offset=-1&live=bogus")),
    Case("live-sse-without-offset", lambda c: get(c, "live=sse")),
    # -- header and request smuggling, injection --
    Case("header-bare-lf", lambda c: post(c, [("Stream-Seq", "a\nX-Evil: 1")])),
    Case("header-bare-cr", lambda c: post(c, [("Stream-Seq", "a\rX-Evil: 1")])),
    Case("header-nul", lambda c: post(c, [("Stream-Seq", "a\0b")])),
    Case("header-space-before-colon", lambda c: post(c, [("Stream-Seq ", "a")])),
    Case("header-obs-fold", lambda c: put_fresh(c, [("Content-Type", "text/plain\r\n X-Evil: 1")])),
    Case("path-crlf", lambda c: req("PUT", f"{P}{c.fresh}%0d%0aSet-Cookie:%20evil=1")),
    Case("path-nul", lambda c: req("PUT", f"{P}{c.fresh}%00x")),
    Case(
        "te-and-content-length",
        lambda c: post(
            c, [("Transfer-Encoding", "chunked"), ("Content-Length", "3")], b"2\r\nx;\r\n0\r\n\r\n"
        ),
    ),  # fmt: skip
    Case("two-content-lengths", lambda c: post(c, [("Content-Length", "2"), ("Content-Length", "3")], b"x;")),
    Case("content-length-negative", lambda c: post(c, [("Content-Length", "-1")], b"")),
    Case("content-length-huge", lambda c: post(c, [("Content-Length", "9" * 30)], b"x;")),
    Case(
        "chunk-size-garbage", lambda c: post(c, [("Transfer-Encoding", "chunked")], b"zz\r\nx;\r\n0\r\n\r\n")
    ),
    Case(
        "chunk-size-overflow",
        lambda c: post(c, [("Transfer-Encoding", "chunked")], b"fffffffffffffffffff\r\nx;\r\n0\r\n\r\n"),
    ),  # fmt: skip
    # -- paths --
    Case("path-100k", lambda c: req("PUT", P + "a" * 100_000)),
    Case("path-2000", lambda c: req("PUT", P + c.fresh + "a" * 2000)),
    Case("path-raw-ff", lambda c: req("PUT", (P + c.fresh).encode() + b"\xff")),
    Case("path-reserved", lambda c: req("PUT", P + "__ds/" + c.fresh)),
    Case(
        "path-dot-dot",
        lambda c: req("PUT", P + "../../etc/" + c.fresh),
        strict=False,
        on_accept=dot_dot_readable,
    ),
    # -- methods, bodies where none belongs --
    Case(
        "get-with-smuggled-body",
        lambda c: req(
            "GET", P + c.victim, [], req("POST", P + c.victim, [("Content-Type", "text/plain")], b"evil;")
        ),
        strict=False,
    ),  # fmt: skip
    Case("head-with-body", lambda c: req("HEAD", P + c.victim, [], b"evil;"), strict=False),
    Case("options-with-body", lambda c: req("OPTIONS", P + c.victim, [], b"evil;"), strict=False),
    Case("delete-missing-with-body", lambda c: req("DELETE", P + c.fresh, [], b"evil;")),
    Case("unknown-method-with-body", lambda c: req("FROB", P + c.victim, [], b"evil;")),
    Case("patch", lambda c: req("PATCH", P + c.victim, [("Content-Type", "text/plain")], b"evil;")),
    Case("post-empty-body", lambda c: post(c, [], b"")),
    Case("post-no-content-type", lambda c: req("POST", P + c.victim, [], b"evil;")),
    # -- producer headers --
    Case("producer-partial", lambda c: post(c, [("Producer-Id", "p")])),
    Case(
        "producer-epoch-2^53",
        lambda c: post(c, [("Producer-Id", "p"), ("Producer-Epoch", str(2**53)), ("Producer-Seq", "0")]),
    ),  # fmt: skip
    Case(
        "producer-id-empty",
        lambda c: post(c, [("Producer-Id", ""), ("Producer-Epoch", "0"), ("Producer-Seq", "0")]),
    ),
    Case(
        "producer-seq-plus",
        lambda c: post(c, [("Producer-Id", "p"), ("Producer-Epoch", "0"), ("Producer-Seq", "+1")]),
    ),
]


def _b64(raw: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


# A JWT that asks not to be verified ("alg": "none") and grants everything.
ALG_NONE = ".".join([_b64(b'{"alg":"none","typ":"JWT"}'), _b64(b'{"exp":9999999999,"streams":"admin:"}'), ""])


def without_credentials(ctx: Ctx, method: str, target: str, headers, body: bytes = b"x;") -> bytes:  # type: ignore[no-untyped-def]
    """A request that carries only the credentials it names (not the battery's token)."""
    return rawhttp.build(method, target, [("Content-Type", "text/plain"), *headers], body)


def post_as(value: bytes | str) -> Build:
    """An append to the victim with this Authorization header alone."""
    return lambda c: without_credentials(c, "POST", P + c.victim, [(b"Authorization", value)])


def signed(method: str, query: str, headers=(), body: bytes = b"x;") -> Build:  # type: ignore[no-untyped-def]
    """A request to the victim with a signed-URL query and no other credentials."""
    return lambda c: without_credentials(c, method, f"{P}{c.victim}?{query}", list(headers), body)


# With access control on: credentials that are malformed, forged or not for this
# stream. Each must be 401/403 and store nothing.
AUTH_CASES: list[Case] = [
    Case("auth-not-utf8", post_as(b"Bearer \xff\xfe"), repeat=5),
    Case("auth-latin1", post_as(b"Bearer caf\xe9-token-0123456789"), repeat=5),
    Case("auth-bearer-empty", post_as("Bearer")),
    Case("auth-bearer-huge", post_as("Bearer " + "a" * 6000)),
    Case("auth-jwt-garbage", post_as("Bearer a.b.c"), repeat=5),
    Case("auth-jwt-alg-none", post_as("Bearer " + ALG_NONE), repeat=5),
    Case("auth-basic", post_as("Basic YTpi")),
    Case(
        "auth-bad-then-good",  # two Authorization headers: the first is the one that counts
        lambda c: without_credentials(
            c,
            "POST",
            P + c.victim,
            [("Authorization", "Bearer nope-nope-nope"), ("Authorization", f"Bearer {TOKEN}")],
        ),
    ),
    Case("auth-none-delete", lambda c: without_credentials(c, "DELETE", P + c.victim, [])),
    Case("signed-url-bad-expiry", signed("POST", "ds_expires=abc&ds_scope=write&ds_sig=x")),
    Case("signed-url-huge-expiry", signed("POST", f"ds_expires={'9' * 400}&ds_scope=write&ds_sig=x")),
    Case("signed-url-not-utf8", signed("GET", "ds_expires=9999999999&ds_scope=read&ds_sig=%ff%fe&offset=-1")),
]


@dataclass
class Battery:
    port: int
    base: str
    seed: int
    failures: list[str] = field(default_factory=list)
    sent: int = 0
    five_xx: int = 0
    windows: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, case) per request
    clock: Clock = field(default_factory=Clock)

    def raw(self, request: bytes, timeout: float = 10.0) -> rawhttp.RawResponse:
        return rawhttp.send(self.port, request, timeout=timeout)

    def head_status(self, path: str) -> int:
        r = self.raw(req("HEAD", P + path))
        return r.status if r.status is not None else 599

    def state(self, path: str) -> tuple[int | None, bytes | None, bytes | None, bytes | None]:
        """HEAD status, tail, closed flag and content type of a stream."""
        r = self.raw(req("HEAD", P + path))
        return r.status, r.header("Stream-Next-Offset"), r.header("Stream-Closed"), r.header("Content-Type")

    def read(self, path: str) -> bytes:
        r = self.raw(req("GET", f"{P}{path}?offset=-1"))
        return r.body

    def run_case(self, case: Case, ctx: Ctx) -> None:
        """Send the case ``repeat`` times; its failures are reported once, with how many attempts failed."""
        found: dict[str, list[int]] = {}  # failure (without the attempt number) -> attempts
        for attempt in range(case.repeat):
            for failure in self._attempt(case, ctx):
                found.setdefault(failure, []).append(attempt + 1)
        for failure, attempts in found.items():
            tries = f" (attempts {attempts} of {case.repeat})" if case.repeat > 1 else ""
            self.failures.append(f"bad input {case.name!r}{tries}: {failure}")

    def _attempt(self, case: Case, ctx: Ctx) -> list[str]:
        failures: list[str] = []
        before = (self.state(ctx.victim), self.read(ctx.victim))
        request = case.build(ctx)
        started = self.clock()
        response = self.raw(request, case.timeout)
        self.windows.append((started, self.clock(), case.name))
        self.sent += 1
        status = response.status
        if status is not None and status >= 500:
            self.five_xx += 1
        if status is None and response.error and not response.timed_out:
            # Hanging up without an answer is acceptable for garbage that cannot be parsed,
            # as long as it happens at once.
            if response.elapsed > case.timeout:
                failures.append(f"no answer, connection closed after {response.elapsed:.1f}s")
        elif status is None:
            failures.append(f"{response.describe()} (bound {case.timeout}s)")
        elif status >= 500 or (case.strict and not 400 <= status < 500):
            failures.append(f"answered {response.describe()}; expected 4xx")
        head = response.raw.split(b"\r\n\r\n", 1)[0].lower()
        if b"\r\nx-evil" in head or b"set-cookie" in head:
            failures.append(f"the response carries a smuggled header: {head[:400]!r}")
        accepted = status is not None and 200 <= status < 300
        if accepted and not case.strict and case.on_accept is not None:
            failures += [f"answered {status}, but {v}" for v in case.on_accept(ctx, response, self)]
        if not accepted or case.name.startswith(("get-", "head-", "options-", "offset-")):
            failures += self._stored_nothing(status, ctx, before)
        return failures

    def _stored_nothing(self, status: int | None, ctx: Ctx, before: tuple) -> list[str]:  # type: ignore[type-arg]
        failures = []
        after = (self.state(ctx.victim), self.read(ctx.victim))
        if after != before:
            failures.append(
                f"answered {status}, yet its victim stream {ctx.victim!r} changed: "
                f"(HEAD status, tail, closed, type) and content were {before}, are {after}"
            )
        fresh = self.head_status(ctx.fresh)
        if fresh != 404:
            failures.append(
                f"answered {status}, yet stream {ctx.fresh!r} it tried to create answers HEAD {fresh}"
            )
        return failures


def lane_streams(count: int) -> list[str]:
    """Stream names covering every append lane (see gateway/streams/appends.py), so a bad append
    always shares its lane, and so its batches, with legitimate ones."""
    try:
        from gateway.redis_io import keys
        from gateway.redis_io.limits import APPEND_LANES
    except ImportError:  # names only: any layout still gets `count` streams
        return [f"legit-{i}" for i in range(count)]
    names: list[str] = []
    lanes: set[int] = set()
    i = 0
    while len(names) < count or (len(lanes) < APPEND_LANES and i < 1000):
        name = f"legit-{i}"
        lane = zlib.crc32(keys.stream_id(name).encode()) % APPEND_LANES
        if lane not in lanes or len(names) < count:
            names.append(name)
            lanes.add(lane)
        i += 1
    return names


@pytest.mark.parametrize("access", ["off", "on"])
async def test_bad_input_battery_beside_legitimate_appends(
    tmp_path: Path, fault_seed: int, summary: Summary, access: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``access``: with access control on (a token file, and rate limits too high to refuse),
    the same battery, each request carrying a valid admin token: 0 answered 5xx still."""
    try:
        find_redis_server()
    except RuntimeError:
        pytest.skip("needs a redis-server binary")
    rng = random.Random(f"{fault_seed}:battery")
    flags = ["--max-body-bytes", str(MAX_BODY), "--long-poll-timeout", "2", "--sse-cycle-seconds", "3"]
    session_headers: dict[str, str] = {}
    if access == "on":
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps({"tokens": [{"name": "battery", "token": TOKEN, "grants": "admin:"}]}))
        flags += ["--auth-tokens-file", str(tokens), "--rate-limits", "write:=1000000/s read:=1000000/s"]
        monkeypatch.setattr(f"{__name__}.CREDENTIALS", [("Authorization", f"Bearer {TOKEN}")])
        session_headers = {"Authorization": f"Bearer {TOKEN}"}
    with harness.cluster(tmp_path, gateways=1, archivers=0, gateway_flags=flags) as cluster:
        gw = cluster.gateways[0]
        battery = Battery(gw.port, gw.base, fault_seed)
        cases = list(CASES) + (AUTH_CASES if access == "on" else [])
        rng.shuffle(cases)
        async with aiohttp.ClientSession(headers=session_headers) as session:
            contexts: dict[str, Ctx] = {}
            for n, case in enumerate(cases):
                ctx = Ctx(victim=f"victim-{n}-{case.name}", fresh=f"fresh-{n}-{case.name}", port=gw.port)
                ct = "application/json" if case.json else "text/plain"
                body = b'{"kept":true}' if case.json else b"kept;"
                async with session.put(
                    f"{gw.base}{P}{ctx.victim}", data=body, headers={"Content-Type": ct}
                ) as r:
                    assert r.status == 201, f"create {ctx.victim}: {r.status}"
                contexts[case.name] = ctx

            legit = lane_streams(8)
            for name in legit:
                async with session.put(f"{gw.base}{P}{name}", headers={"Content-Type": "text/plain"}) as r:
                    assert r.status == 201
            stop = asyncio.Event()
            stats = Stats()
            histories: dict[str, list[Append]] = {name: [] for name in legit}
            timing = Timing(request_timeout=10.0)

            async def legit_writer(stream: str, writer: str) -> None:
                for seq in range(100_000):
                    if stop.is_set():
                        return
                    append = Append(stream, writer, seq)
                    histories[stream].append(append)
                    await post_record(session, gw.base, append, timing, battery.clock, stats)

            writers = [
                asyncio.create_task(legit_writer(name, f"{name}w{k}")) for name in legit for k in range(2)
            ]
            await asyncio.sleep(0.3)
            loop = asyncio.get_running_loop()
            started = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                await asyncio.gather(*(
                    loop.run_in_executor(pool, battery.run_case, case, contexts[case.name]) for case in cases
                ))  # fmt: skip
            battery_seconds = time.monotonic() - started
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*writers)

            failures = list(battery.failures)
            legit_total = 0
            for stream, appends in histories.items():
                legit_total += len(appends)
                failed = [a for a in appends if a.outcome != "acked"]
                if failed:
                    answers = Counter(str(t.status or t.error) for a in failed for t in a.attempts)
                    suspects: Counter[str] = Counter()
                    for a in failed:
                        t = a.attempts[0]
                        suspects.update(
                            {c for s, e, c in battery.windows if s <= t.at + t.took and e >= t.at}
                        )
                    failures.append(
                        f"{len(failed)} of {len(appends)} legitimate appends to {stream!r} failed while the "
                        f"battery ran (answers {dict(answers)}), e.g. {[a.describe() for a in failed[:3]]}; "
                        f"bad requests in flight at those moments (times seen): {suspects.most_common(12)}"
                    )
                content = await read_all(session, gw.base, stream)
                failures += [
                    v
                    for v in check_stream(stream, content, appends, context=f"seed {fault_seed}")
                    if "a valid append was answered" not in v  # reported above, with the suspects
                ]
    summary.bad_inputs += battery.sent
    summary.bad_input_5xx += battery.five_xx
    summary.legit_during_battery += legit_total
    summary.violations += len(failures)
    print(
        f"\nbattery (access control {access}): {battery.sent} bad requests ({len(cases)} cases) in "
        f"{battery_seconds:.1f}s beside "
        f"{legit_total} legitimate appends; {battery.five_xx} answered 5xx; {len(failures)} failures"
    )
    if failures:
        shown = failures[:80]
        pytest.fail(
            f"{len(failures)} failures (seed {fault_seed}), {battery.sent} bad requests, {battery.five_xx} "
            f"answered 5xx, {legit_total} legitimate appends:\n  "
            + "\n  ".join(shown)
            + (f"\n  ... and {len(failures) - len(shown)} more" if len(failures) > len(shown) else "")
            + f"\ngateway log: {gw.log_path}",
            pytrace=False,
        )
