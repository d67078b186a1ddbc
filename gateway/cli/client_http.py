"""The command-line client's HTTP: one session's requests (``Client``), what ends a command
(``Failure``) and the exit codes scripts rely on (``EXIT_CODES``, also in every command's
``--help``): the class of what went wrong, not the exact status. An error is one line on
stderr: the status, the server's message, the URL.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDictProxy

TOKEN_ENV = "DURABLE_STREAMS_TOKEN"
PROBE_BYTES = 1 << 16  # a listing page of one stream, an error: a larger answer is none of these

OK, OTHER, USAGE, NOT_FOUND, CONFLICT, UNAUTHORIZED, UNAVAILABLE, BAD_REQUEST = range(8)
INTERRUPTED = 130  # the shell's code for SIGINT
EXIT_CODES = """exit codes:
  0  ok
  1  other error (e.g. a 500)
  2  usage (also: --url is a server's address whose stream prefix could not be found)
  3  not found or gone (404, 410)
  4  conflict (409: stream closed, configuration mismatch, producer sequence gap; 403 producer fencing)
  5  unauthorized or forbidden (401, 403)
  6  unavailable or timed out (503, 504, connection refused, timeouts)
  7  bad request or too large (400, 413, any other 4xx)
  130 interrupted (Ctrl-C)"""


class Failure(Exception):
    """What ends a command: one line for stderr, and the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    reason: str = ""


def exit_code(status: int, headers: Mapping[str, str] | None = None) -> int:
    """The exit code class of an HTTP error status."""
    if status in (404, 410):
        return NOT_FOUND
    if status == 409:
        return CONFLICT
    if status == 403 and headers is not None and "Producer-Epoch" in headers:
        return CONFLICT  # a stale producer epoch: fenced by a newer producer, not an access refusal
    if status in (401, 403):
        return UNAUTHORIZED
    if status in (503, 504):
        return UNAVAILABLE
    if 400 <= status < 500:
        return BAD_REQUEST
    return OTHER


def _server_message(body: bytes) -> str:
    """The server's reason, on one line: a text body's first line, or a JSON error's message."""
    text = body.decode("utf-8", "replace").strip()
    with contextlib.suppress(ValueError):
        found = json.loads(text)
        if isinstance(found, dict):
            text = str(found.get("error") or found.get("message") or json.dumps(found))
    line = text.splitlines()[0] if text else ""
    return line[:300]


def http_failure(reply: Reply, url: str) -> Failure:
    """An error reply as one line: status, reason, the server's message, the URL."""
    message = _server_message(reply.body)
    head = f"{reply.status} {reply.reason}".strip()
    line = f"{head}: {message} ({url})" if message else f"{head} ({url})"
    return Failure(exit_code(reply.status, reply.headers), line)


def stream_url(base: str, stream: str) -> str:
    """STREAM as a full URL, or a path under the base URL."""
    if stream.startswith(("http://", "https://")):
        return stream
    return f"{base.rstrip('/')}/{stream.lstrip('/')}"


def read_token(token: str | None, token_file: str | None) -> str | None:
    """--token, else --token-file, else $DURABLE_STREAMS_TOKEN (the file's whitespace trimmed)."""
    if token:
        return token
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError as exc:
            raise Failure(USAGE, f"cannot read --token-file: {exc}") from None
    return os.environ.get(TOKEN_ENV) or None


class Client:
    """One session's requests, each failing as a ``Failure`` with its exit code."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float) -> None:
        self.session = session
        self.timeout = timeout

    async def call(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        data: bytes | None = None,
        params: Mapping[str, str] | None = None,
        ok: tuple[int, ...] = (200, 201, 204),
    ) -> Reply:
        sent = dict(headers or {})
        # aiohttp adds a Content-Type (octet-stream) to every request without one, which a
        # fork (it inherits its source's type) would be held to: none unless we say so.
        skip = () if "Content-Type" in sent else ("Content-Type",)
        try:
            async with self.session.request(
                method, url, headers=sent, data=data or None, params=params, skip_auto_headers=skip
            ) as r:
                reply = Reply(r.status, r.headers, await r.read(), r.reason or "")
        except TimeoutError:
            raise Failure(UNAVAILABLE, f"timed out after {self.timeout:g} s ({method} {url})") from None
        except aiohttp.ClientError as exc:
            raise Failure(UNAVAILABLE, f"cannot reach the server: {exc} ({url})") from None
        if reply.status not in ok:
            raise http_failure(reply, url)
        return reply

    async def head(self, url: str) -> Reply:
        return await self.call("HEAD", url, ok=(200,))

    async def probe(self, url: str, given: str, *, params: Mapping[str, str] | None = None) -> Reply:
        """GET ``url`` for what the answer tells of the server: any status, redirects not
        followed, the body only of a small answer (else none). Unreachable, it fails as the
        command would have on ``given`` (--url)."""
        try:
            async with self.session.get(
                url, params=params, allow_redirects=False, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as r:
                body = b""
                async for piece in r.content.iter_any():
                    body += piece
                    if len(body) > PROBE_BYTES:
                        body = b""
                        break
                return Reply(r.status, r.headers, body, r.reason or "")
        except TimeoutError:
            raise Failure(UNAVAILABLE, f"timed out after {self.timeout:g} s ({given})") from None
        except aiohttp.ClientError as exc:
            raise Failure(UNAVAILABLE, f"cannot reach the server: {exc} ({given})") from None
