"""protocol/http1.py: the plain request heads the append fast path frames itself, and
everything else left to aiohttp's parser (OTHER)."""

from __future__ import annotations

import pytest

from gateway.protocol.http1 import MAX_FIELDS, MAX_HEAD_BYTES, OTHER, Head, parse_head

PLAIN = (
    b"POST /v1/stream/a HTTP/1.1\r\nHost: localhost:1\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 5\r\n\r\n"
)


def test_a_plain_head() -> None:
    head = parse_head(PLAIN + b"hello")
    assert isinstance(head, Head)
    assert (head.method, head.target, head.size, head.body_length) == ("POST", "/v1/stream/a", len(PLAIN), 5)
    assert head.headers["content-type"] == "text/plain" and head.headers["HOST"] == "localhost:1"


def test_values_lose_the_blanks_around_them_only() -> None:
    head = parse_head(b"GET / HTTP/1.1\r\nA:x\r\nB: \t y  z\r\nC:\r\n\r\n")
    assert isinstance(head, Head)
    assert list(head.headers.items()) == [("A", "x"), ("B", "y  z"), ("C", "")]
    assert head.body_length == 0


def test_a_head_at_an_offset_and_what_follows_it() -> None:
    data = b"junk" + PLAIN + b"helloPOST"
    head = parse_head(data, 4)
    assert isinstance(head, Head) and head.size == len(PLAIN)


def test_at_most_aiohttps_number_of_fields() -> None:
    def head(fields: int) -> bytes:
        return b"POST /a HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % n for n in range(fields)) + b"\r\n"

    assert isinstance(parse_head(head(MAX_FIELDS)), Head)
    assert parse_head(head(MAX_FIELDS + 1)) is OTHER


def test_incomplete_until_the_blank_line() -> None:
    for end in range(1, len(PLAIN)):
        assert parse_head(PLAIN[:end]) is None, end
    long = b"POST /" + b"x" * (MAX_HEAD_BYTES - 6)
    assert parse_head(long) is None
    assert parse_head(long + b"x") is OTHER  # too long to be ours, complete or not


@pytest.mark.parametrize("start", [b"P", b"POST", b"POST ", b"POST /a", b"O", b"DELETE /a", b"GET"])
def test_incomplete_and_begun_as_a_request_line(start: bytes) -> None:
    assert parse_head(start) is None
    assert parse_head(b"...." + start, 4) is None


@pytest.mark.parametrize(
    "start", [b"def", b"OK", b"ABC /", b"post /", b"\r\n", b"POST/", b"POSTS", b"M-SEARCH", b"\x16\x03"]
)
def test_what_cannot_begin_a_request_line_is_other_at_once(start: bytes) -> None:
    """Say the rest of a body longer than its Content-Length, or TLS on the plain port: llhttp
    refuses it now (400), where waiting for a blank line would hold the connection until
    its keep-alive timeout. (A method this server does not answer goes to llhttp too.)"""
    assert parse_head(start) is OTHER


@pytest.mark.parametrize(
    "data",
    [
        b"POST /a HTTP/1.0\r\n\r\n",  # only HTTP/1.1
        b"post /a HTTP/1.1\r\n\r\n",
        b"POST a HTTP/1.1\r\n\r\n",  # origin-form only
        b"POST http://x/a HTTP/1.1\r\n\r\n",
        b"POST /a  HTTP/1.1\r\n\r\n",
        b"POST /\xc3\xa9 HTTP/1.1\r\n\r\n",  # not ASCII
        b"POST /a HTTP/1.1\r\nA: \xc3\xa9\r\n\r\n",
        b"POST /a HTTP/1.1\r\nA: b\nC: d\r\n\r\n",  # a bare LF
        b"POST /a HTTP/1.1\r\nA: b\rC: d\r\n\r\n",  # a bare CR
        b"POST /a HTTP/1.1\r\nA: b\r\n c\r\n\r\n",  # obs-fold
        b"POST /a HTTP/1.1\r\nA b\r\n\r\n",  # no colon
        b"POST /a HTTP/1.1\r\nA : b\r\n\r\n",  # a blank before the colon
        b"POST /a HTTP/1.1\r\n: b\r\n\r\n",
        b"POST /a HTTP/1.1\r\nA(: b\r\n\r\n",  # not a token
        b"POST /a HTTP/1.1\r\nA: \x01\r\n\r\n",  # a control byte
        b"POST /a HTTP/1.1\r\nA: b \r\n\r\n",  # trailing blanks
        b"POST /a HTTP/1.1\r\nA: 1\r\na: 2\r\n\r\n",  # a repeated field, any case
        b"POST /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
        b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
        b"POST /a HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
        b"POST /a HTTP/1.1\r\nContent-Length: 1,1\r\n\r\n",
        b"POST /a HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n",
        b"POST /a HTTP/1.1\r\nContent-Length: 9999999999999999\r\n\r\n",
        b"POST /a HTTP/1.1\r\nContent-Length: \r\n\r\n",
        b"\r\nPOST /a HTTP/1.1\r\n\r\n",
        b"GET /a HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",  # not HTTP after it
        b"CONNECT /a HTTP/1.1\r\n\r\n",
    ],
)
def test_anything_else_is_aiohttps(data: bytes) -> None:
    assert parse_head(data) is OTHER
