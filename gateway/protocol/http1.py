"""The part of HTTP/1.1 request framing the append fast path reads itself
(``http/fastpath.py``): where one request's head ends, its method, target, fields
and body length, for heads of the plainest form only.

Not an HTTP parser to serve with: anything outside that plain form (a request line
that is not ``METHOD /target HTTP/1.1``, obs-fold, a field name that is not a token,
bytes outside visible ASCII, a repeated field, Transfer-Encoding, Upgrade, CONNECT, a
malformed Content-Length, a head over ``MAX_HEAD_BYTES`` or ``MAX_FIELDS``; as soon as they
come, bytes that cannot begin the request line of a method this server answers) is ``OTHER``:
the connection is then left to aiohttp's parser (llhttp) for good, which answers every such case as
it always did. So this never needs to be lenient, and is never the one to refuse a
request: it only recognises what is unambiguous.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

from multidict import CIMultiDict

# aiohttp's own bound on a request line or field line (``max_line_size``): a head this
# large is not one of ours anyway.
MAX_HEAD_BYTES: Final = 8190
# ... and on fields (``max_headers``): past it llhttp as aiohttp runs it answers 400.
MAX_FIELDS: Final = 128
_END = b"\r\n\r\n"
_REQUEST_LINE = re.compile(r"([A-Z]{1,16}) (/[!-~]*) HTTP/1\.1\r\n")
# What an incomplete head must begin with to be worth waiting for: one of these methods (the
# ones this server answers), whole or in part. Anything else (the rest of a body longer than
# its Content-Length, ...) is OTHER at once, for llhttp to refuse now (or take, for a method
# it knows) rather than wait for a head that never ends.
_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS")  # (gateway/http/app.py's STREAM)
_HEAD_START = re.compile(
    b"|".join(
        [re.escape(m[:n].encode()) + rb"\Z" for m in _METHODS for n in range(1, len(m) + 1)]
        + [m.encode() + b" " for m in _METHODS]
    )
)
# A field line at a line's start: a token, a colon, optional blanks, then visible ASCII and
# blanks. One findall for all of them (a loop of matches cost 2-3x as much).
_FIELD = re.compile(r"^([!#$%&'*+.^_`|~0-9A-Za-z-]+):[\t ]*([\t -~]*)\r\n", re.MULTILINE)


class Head(NamedTuple):
    method: str
    target: str
    headers: CIMultiDict[str]
    size: int  # bytes of the head, its blank line included
    body_length: int  # Content-Length (0 when absent)


class _Other:
    """Outside the plain form: the connection goes to aiohttp's parser."""

    def __repr__(self) -> str:
        return "OTHER"


OTHER: Final = _Other()


def parse_head(data: bytes | bytearray, start: int = 0) -> Head | _Other | None:
    """The head of the request at ``data[start:]``: a Head, None while it is incomplete
    (and still short enough), or OTHER."""
    end = data.find(_END, start, start + MAX_HEAD_BYTES + len(_END))
    if end < 0:  # incomplete: ours to wait for while short and begun as a request line
        if len(data) == start:
            return None
        plausible = len(data) - start <= MAX_HEAD_BYTES and _HEAD_START.match(data, start)
        return None if plausible else OTHER
    try:
        text = data[start : end + 2].decode("ascii")
    except UnicodeDecodeError:
        return OTHER
    request_line = _REQUEST_LINE.match(text)
    if request_line is None:
        return OTHER
    fields = text[request_line.end() :]
    lines = fields.count("\r\n")
    if fields.count("\n") != lines or fields.count("\r") != lines:
        return OTHER  # a bare CR or LF
    if lines > MAX_FIELDS:
        return OTHER
    pairs = _FIELD.findall(fields)
    if len(pairs) != lines:
        return OTHER  # a line that is not a plain field: obs-fold, a control byte, no colon, ...
    if " \r\n" in fields or "\t\r\n" in fields:
        return OTHER  # trailing blanks, which llhttp strips
    if len({name.lower() for name, _ in pairs}) != lines:
        return OTHER  # a repeated field (Content-Length twice, two Hosts, ...): not ours to judge
    headers = CIMultiDict(pairs)
    if "Transfer-Encoding" in headers or "Upgrade" in headers or request_line[1] == "CONNECT":
        return OTHER  # framed otherwise, or not HTTP after it (an upgrade, a tunnel)
    length = headers.get("Content-Length", "0")
    if not length.isdigit() or len(length) > 15:  # ASCII digits: the value is ASCII
        return OTHER
    return Head(request_line[1], request_line[2], headers, end + len(_END) - start, int(length))
