"""The command-line client: ``ls``, ``info``, ``cat``, ``tail``, ``append``, ``create``,
``close``, ``rm`` and ``fork``, speaking the Durable Streams protocol over HTTP
to any server (this one or another): no Redis, nothing of the gateway's below.

Scripts rely on the exit codes (``EXIT_CODES``, also in every command's
``--help``): the class of what went wrong, not the exact status. An error is one
line on stderr: the status, the server's message, the URL.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import aiohttp
from multidict import CIMultiDictProxy

from ..protocol.namespace import RESERVED

DEFAULT_URL = "http://127.0.0.1:4437/v1/stream"
URL_ENV, TOKEN_ENV = "DURABLE_STREAMS_URL", "DURABLE_STREAMS_TOKEN"
DEFAULT_CONTENT_TYPE = "application/octet-stream"  # what the protocol (and this server) default to
JSON_TYPE = "application/json"
SSE_READ_SECONDS = 60.0  # an SSE connection silent this long is dead: servers send heartbeats (15 s here)
RECONNECT_MAX_SECONDS = 5.0  # longest pause between tail's reconnection attempts
PRODUCER_RETRIES = 3  # a producer's append is deduplicated by the server: resending it is safe
STREAM_PREFIX = "/v1/stream"  # the protocol's usual prefix, this server's default --prefix
LISTING = f"{RESERVED}/streams"  # the listing API under the streams' base URL (this server's)
CONSOLE = f"{RESERVED}/console/"  # this server's web console under the streams' base URL, where GET / leads

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


def _position(offset: str | None) -> int | None:
    """The byte position in an offset of this server's form (``<generation>_<position>``), for
    the progress bar only: offsets are opaque, another server's give no bar."""
    if not offset:
        return None
    tail = offset.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


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


# --- --url given as the server's address -------------------------------------------------------
#
# The streams live under the server's prefix (--prefix, /v1/stream by default): the server's
# bare address as --url puts every path beside them, where this server has Ursula's bucket
# routes (a request there fails as a bucket's, "'__ds' is the name of one of the server's
# routes"), or nothing. No endpoint states the prefix; when --url has no path, the client
# looks for it (at most three GETs, before any request of the command's own):
#   1. GET <url>/__ds/streams: the listing there: the streams live at the root, --url is right;
#   2. GET <url>/ leads to the console at <prefix>/__ds/console/ (when it is on): that prefix;
#   3. GET <url>/v1/stream/__ds/streams: the listing there: the usual prefix.
# Found: the command goes on there, with a note on stderr. Not found, and 1. was this server's
# bucket refusal: a usage error naming the URL to give. Anything else (another server): --url
# as given, as before.

PROBE_BYTES = 1 << 16  # a listing page of one stream, an error: a larger answer is none of these


def _server_address(url: str) -> bool:
    """Whether --url has no path: the streams' base URL only for a server serving them at its root."""
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and parts.path in ("", "/") and not parts.query


def _puts_paths_under_url(args: argparse.Namespace) -> bool:
    """Whether the command makes a URL under --url (ls always, the others unless every
    STREAM is a full URL)."""
    if args.command == "ls":
        return True
    named = (getattr(args, name, None) for name in ("stream", "source"))
    return any(value is not None and not value.startswith(("http://", "https://")) for value in named)


def _is_listing(reply: Reply) -> bool:
    """A listing's answer, or its refusal of these credentials: the listing lives here."""
    if reply.status in (401, 403):
        return True
    with contextlib.suppress(ValueError):
        found = json.loads(reply.body) if reply.status == 200 else None
        return isinstance(found, dict) and isinstance(found.get("streams"), list)
    return False


def _is_bucket_refusal(reply: Reply) -> bool:
    """This server's answer to ``/__ds/...`` at its root when its streams live under a prefix."""
    with contextlib.suppress(ValueError):
        found = json.loads(reply.body) if reply.status == 400 else None
        error = found.get("error") if isinstance(found, dict) else None
        return isinstance(error, dict) and error.get("code") == "invalid_bucket_id"
    return False


async def _console_base(client: Client, origin: str, given: str) -> str | None:
    """The streams' base URL that ``GET /`` names, leading to the console under it."""
    reply = await client.probe(origin + "/", given)
    location = reply.headers.get("Location") if 300 <= reply.status < 400 else None
    if not location:
        return None
    target, here = urlsplit(urljoin(origin + "/", location)), urlsplit(origin)
    elsewhere = (target.scheme, target.netloc) != (here.scheme, here.netloc)
    if elsewhere or not target.path.endswith("/" + CONSOLE):
        return None
    prefix = target.path[: -len(CONSOLE)].rstrip("/")
    return urlunsplit((here.scheme, here.netloc, prefix, "", "")) if prefix else None


async def _usual_base(client: Client, origin: str, given: str) -> str | None:
    base = origin + STREAM_PREFIX
    reply = await client.probe(stream_url(base, LISTING), given, params={"limit": "1"})
    return base if _is_listing(reply) else None


async def find_base(client: Client, args: argparse.Namespace) -> None:
    """--url made the streams' base URL when it is the server's address (above)."""
    given = args.url
    origin = given.rstrip("/")
    at_root = await client.probe(stream_url(origin, LISTING), given, params={"limit": "1"})
    if _is_listing(at_root):
        return
    base = await _console_base(client, origin, given) or await _usual_base(client, origin, given)
    if base is not None:
        print(
            f"durable-streams {args.command}: note: using {base} (the server's stream prefix); "
            "pass it as --url to skip this check",
            file=sys.stderr,
            flush=True,
        )
        args.url = base
    elif _is_bucket_refusal(at_root):
        raise Failure(
            USAGE,
            f"--url {given} is the server's address, not the streams' base URL, and its stream prefix "
            f"is not {STREAM_PREFIX}: pass --url {origin}/PREFIX, PREFIX being the server's --prefix "
            "(DURABLE_STREAMS_PREFIX)",
        )


@contextlib.asynccontextmanager
async def _client(args: argparse.Namespace, *, live: bool = False) -> AsyncIterator[Client]:
    token = read_token(args.token, args.token_file)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if live:  # a live read lasts: only connecting and silence are bounded
        timeout = aiohttp.ClientTimeout(total=None, connect=args.timeout, sock_read=SSE_READ_SECONDS)
    else:
        timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        client = Client(session, args.timeout)
        if _server_address(args.url) and _puts_paths_under_url(args):
            await find_base(client, args)  # may change args.url: URLs under it are made after this
        yield client


def _emit(data: bytes) -> None:
    """Bytes to stdout as they are, after any text printed before them."""
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def _print_json(value: dict[str, Any]) -> None:
    print(json.dumps(value), flush=True)


def _json_lines(body: bytes) -> bytes:
    """A JSON stream's chunk (an array of messages) as one compact message per line."""
    messages = json.loads(body) if body.strip() else []
    return b"".join(
        json.dumps(m, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for m in messages
    )


def _is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON_TYPE


def _body(data: list[str], content_type: str | None) -> bytes:
    """DATA arguments, else stdin. Arguments are joined by newlines (none added at the end);
    on a JSON stream each argument is one message (sent as one array)."""
    if not data:
        return sys.stdin.buffer.read()
    if _is_json(content_type) and len(data) > 1:
        return ("[" + ",".join(data) + "]").encode()
    return "\n".join(data).encode()


# --- commands ---------------------------------------------------------------------------------


async def ls(args: argparse.Namespace) -> int:
    """The streams under PREFIX, page after page (``next_cursor``) until ``--limit``."""
    listed, after = 0, ""
    async with _client(args) as client:
        url = stream_url(args.url, LISTING)
        while args.limit is None or listed < args.limit:
            size = 1000 if args.limit is None else min(1000, args.limit - listed)
            params = {"prefix": args.prefix, "limit": str(size), **({"after": after} if after else {})}
            page = json.loads((await client.call("GET", url, params=params, ok=(200,))).body)
            for item in page["streams"][:size]:
                listed += 1
                if args.json:
                    _print_json(item)
                elif args.long:
                    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(item["created_at_ms"] / 1000))
                    print(
                        f"{item['status']:<7}{item['bytes']:>12} {created}  "
                        f"{item['content_type']:<26} {item['path']}"
                    )
                else:
                    print(item["path"])
            after = page.get("next_cursor") or ""
            if not page.get("has_more") or not after:
                break
    return OK


async def info(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        url = stream_url(args.url, args.stream)
        h = (await client.head(url)).headers
    found = {
        "url": url,
        "content_type": h.get("Content-Type"),
        "next_offset": h.get("Stream-Next-Offset"),
        "closed": h.get("Stream-Closed", "").lower() == "true",
        "ttl": int(h["Stream-TTL"]) if h.get("Stream-TTL", "").isdigit() else None,
        "expires_at": h.get("Stream-Expires-At"),
        "forked_from": h.get("Stream-Forked-From"),  # when the server says (the protocol does not require it)
        "fork_offset": h.get("Stream-Fork-Offset"),
    }
    if args.json:
        _print_json(found)
        return OK
    for name, value in found.items():
        if value is None:
            value = "-"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        elif name == "ttl":
            value = f"{value} s (sliding: reset by every read and write)"
        print(f"{name.replace('_', '-') + ':':<14}{value}")
    return OK


class Progress:
    """A byte-count bar on stderr, only when stderr is a terminal (never in a pipe or a log)."""

    def __init__(self, start: int | None, total: int | None) -> None:
        self.on = sys.stderr.isatty() and start is not None and total is not None and total > (start or 0)
        self.start, self.total = max(start or 0, 0), total or 0

    def show(self, position: int | None) -> None:
        if not self.on or position is None:
            return
        done = min(max(position - self.start, 0), self.total - self.start)
        share = done / (self.total - self.start)
        bar = "#" * int(share * 30)
        sys.stderr.write(f"\r[{bar:<30}] {share:4.0%} {done}/{self.total - self.start} bytes")
        sys.stderr.flush()

    def end(self) -> None:
        if self.on:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


async def cat(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        url = stream_url(args.url, args.stream)
        head = (await client.head(url)).headers  # the content type, and the tail for the bar
        is_json = _is_json(head.get("Content-Type"))
        if args.json_lines and not is_json:
            raise Failure(USAGE, f"--json-lines: {url} is {head.get('Content-Type')}, not {JSON_TYPE}")
        offset = args.offset
        progress = Progress(
            _position(offset) if offset != "-1" else 0, _position(head.get("Stream-Next-Offset"))
        )
        first = True
        if is_json and not args.json_lines:
            _emit(b"[")  # the chunks' arrays joined into one
        try:
            while True:
                reply = await client.call("GET", url, params={"offset": offset}, ok=(200,))
                body = reply.body
                if args.json_lines:
                    _emit(_json_lines(body))
                elif is_json:
                    inner = body.strip()[1:-1]
                    if inner.strip():
                        _emit((b"" if first else b",") + inner)
                        first = False
                else:
                    _emit(body)
                offset = reply.headers.get("Stream-Next-Offset", offset)
                progress.show(_position(offset))
                if reply.headers.get("Stream-Up-To-Date", "").lower() == "true":
                    break
                if reply.headers.get("Stream-Closed", "").lower() == "true" or not body:
                    break  # EOF; an empty body without up-to-date would loop forever
        finally:
            progress.end()
        if is_json and not args.json_lines:
            _emit(b"]")
    return OK


@dataclass
class _Event:
    kind: str = "message"
    data: list[str] | None = None


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    """(event, data) pairs of an SSE body. Lines are split here, not by aiohttp's readline,
    whose line limit a large data event (a base64 chunk) would exceed."""
    buffer, event = b"", _Event()
    async for piece in response.content.iter_any():
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if event.data is not None:
                    yield event.kind, "\n".join(event.data)
                event = _Event()
            elif line.startswith(":"):
                continue  # a heartbeat comment
            else:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    event.kind = value
                elif field == "data":
                    event.data = (event.data or []) + [value]


async def tail(args: argparse.Namespace) -> int:
    offset, cursor = args.offset, None
    async with _client(args, live=True) as client:
        url = stream_url(args.url, args.stream)
        head = (await client.head(url)).headers
        is_json = _is_json(head.get("Content-Type"))
        failing_since: float | None = None
        pause = 0.2
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        while True:
            # Ctrl-C cancels this task (asyncio.run): a cancellation some library swallowed,
            # ending a response early or raised as a connection error, must not become a
            # reconnect, or tail never exits.
            if task.cancelling():
                raise asyncio.CancelledError
            params = {"offset": offset, "live": "sse", **({"cursor": cursor} if cursor else {})}
            try:
                async with client.session.get(
                    url, params=params, headers={"Accept": "text/event-stream"}
                ) as r:
                    if r.status != 200:
                        reply = Reply(r.status, r.headers, await r.read(), r.reason or "")
                        if r.status not in (502, 503, 504):
                            raise http_failure(reply, url)
                        raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
                    failing_since, pause = None, 0.2
                    binary = r.headers.get("Stream-SSE-Data-Encoding", "").lower() == "base64"
                    async for kind, data in _sse_events(r):
                        if kind == "data":
                            payload = (
                                base64.b64decode(data.replace("\n", "").replace("\r", ""))
                                if binary
                                else data.encode()
                            )
                            _emit(_json_lines(payload) if is_json else payload)
                        elif kind == "control":
                            control = json.loads(data)
                            offset = control.get("streamNextOffset", offset)
                            cursor = control.get("streamCursor", cursor)
                            if control.get("streamClosed"):
                                return OK  # EOF: the protocol forbids reconnecting
            except (aiohttp.ClientError, TimeoutError) as exc:
                # A dropped connection or a server restarting: resume from the last offset,
                # until it has failed for longer than --timeout.
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since > args.timeout:
                    raise Failure(
                        UNAVAILABLE,
                        f"lost the stream for over {args.timeout:g} s: {exc or type(exc).__name__} ({url})",
                    ) from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECONNECT_MAX_SECONDS)
            # The server ended the response (its cycle, for CDN collapsing): reconnect at once.


def _producer_headers(args: argparse.Namespace) -> dict[str, str]:
    if args.producer_id is None:
        if args.epoch is not None or args.seq is not None:
            raise Failure(USAGE, "--epoch and --seq need --producer-id")
        return {}
    return {
        "Producer-Id": args.producer_id,
        "Producer-Epoch": str(args.epoch or 0),
        "Producer-Seq": str(args.seq or 0),
    }


async def append(args: argparse.Namespace) -> int:
    producer = _producer_headers(args)
    async with _client(args) as client:
        url = stream_url(args.url, args.stream)
        content_type = args.content_type or (await client.head(url)).headers.get("Content-Type")
        body = _body(args.data, content_type)
        headers = dict(producer)
        if body:
            headers["Content-Type"] = content_type or DEFAULT_CONTENT_TYPE
        if args.close:
            headers["Stream-Closed"] = "true"
        attempts = 1 + (PRODUCER_RETRIES if producer else 0)
        for attempt in range(attempts):
            try:
                reply = await client.call("POST", url, headers=headers, data=body)
                break
            except Failure as exc:
                if exc.code != UNAVAILABLE or attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2 * 2**attempt)  # same producer seq: a duplicate is dropped
    result = {
        "url": url,
        "next_offset": reply.headers.get("Stream-Next-Offset"),
        "closed": reply.headers.get("Stream-Closed", "").lower() == "true",
    }
    if producer:  # 204 to a producer's append: this batch was appended before (a retry)
        result["duplicate"] = reply.status == 204
        result["producer_epoch"] = reply.headers.get("Producer-Epoch")
        result["producer_seq"] = reply.headers.get("Producer-Seq")
    if args.json:
        _print_json(result)
    else:
        note = " (duplicate: appended before)" if result.get("duplicate") else ""
        print(f"{result['next_offset']}{note}")
    return OK


def _lifetime_headers(args: argparse.Namespace) -> dict[str, str]:
    headers = {}
    if args.ttl is not None:
        headers["Stream-TTL"] = str(args.ttl)
    if args.expires_at is not None:
        headers["Stream-Expires-At"] = args.expires_at
    return headers


def _created(args: argparse.Namespace, url: str, reply: Reply, extra: dict[str, Any]) -> int:
    result = {
        "url": url,
        "created": reply.status == 201,  # 200: it existed already, with this configuration
        "content_type": reply.headers.get("Content-Type"),
        "next_offset": reply.headers.get("Stream-Next-Offset"),
        "closed": reply.headers.get("Stream-Closed", "").lower() == "true",
        **extra,
    }
    if args.json:
        _print_json(result)
    else:
        what = "created" if result["created"] else "exists"
        print(f"{what} {url} ({result['content_type']}, next offset {result['next_offset']})")
    return OK


async def create(args: argparse.Namespace) -> int:
    content_type = args.content_type or DEFAULT_CONTENT_TYPE
    headers = {"Content-Type": content_type, **_lifetime_headers(args)}
    if args.closed:
        headers["Stream-Closed"] = "true"
    body = _body(args.data, content_type) if args.data else b""  # never waits on stdin
    async with _client(args) as client:
        url = stream_url(args.url, args.stream)
        reply = await client.call("PUT", url, headers=headers, data=body, ok=(200, 201))
    return _created(args, url, reply, {})


async def fork(args: argparse.Namespace) -> int:
    headers = _lifetime_headers(args)
    if args.offset is not None:
        headers["Stream-Fork-Offset"] = args.offset
    if args.content_type:
        headers["Content-Type"] = args.content_type
    async with _client(args) as client:
        url = stream_url(args.url, args.stream)
        source = stream_url(args.url, args.source)
        headers["Stream-Forked-From"] = urlsplit(source).path
        reply = await client.call("PUT", url, headers=headers, data=b"", ok=(200, 201))
    return _created(args, url, reply, {"forked_from": source, "fork_offset": args.offset})


async def close(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        url = stream_url(args.url, args.stream)
        reply = await client.call("POST", url, headers={"Stream-Closed": "true"}, data=b"")
    offset = reply.headers.get("Stream-Next-Offset")
    if args.json:
        _print_json({"url": url, "closed": True, "next_offset": offset})
    else:
        print(f"closed {url} at {offset}")
    return OK


async def rm(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        url = stream_url(args.url, args.stream)
        await client.call("DELETE", url, ok=(200, 202, 204))
    if args.json:
        _print_json({"url": url, "deleted": True})
    else:
        print(f"deleted {url}")
    return OK


# --- registration -----------------------------------------------------------------------------


def _run(command: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    """A command's coroutine run to its exit code; failures as one line on stderr."""

    def main(args: argparse.Namespace) -> int:
        try:
            return int(asyncio.run(command(args)))
        except Failure as exc:
            print(f"durable-streams {args.command}: {exc}", file=sys.stderr)
            return exc.code
        except KeyboardInterrupt:
            return INTERRUPTED
        except BrokenPipeError:  # `cat | head`: the reader left, which is no error of ours
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return OK

    return main


class _Intermixed(argparse.ArgumentParser):
    """Options anywhere among the positionals (``append s --url U hello``): plain argparse
    takes STREAM and an empty DATA together and then refuses ``hello``. The subparsers
    action calls ``parse_known_args``; the intermixed parse calls it again, inside."""

    _inside = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get(URL_ENV) or DEFAULT_URL,
        help=f"the streams' base URL (a server's address alone: its stream prefix is looked for) "
        f"[env {URL_ENV}; default: %(default)s]",
    )
    common.add_argument("--token", help=f"bearer token [env {TOKEN_ENV}]")
    common.add_argument("--token-file", help="file holding the bearer token")
    common.add_argument(
        "--timeout", type=float, default=30.0, help="seconds a request may take [default: 30]"
    )
    return common


def _add(
    commands: argparse._SubParsersAction[Any],
    name: str,
    command: Callable[[argparse.Namespace], Any],
    summary: str,
    *,
    json_output: bool = True,
    positional: str = "stream",
) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ". STREAM is a path under --url, or a full URL.",
        parents=[_common()],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if positional == "stream":
        parser.add_argument("stream", metavar="STREAM" if name != "fork" else "NEW")
    if json_output:
        parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.set_defaults(main=_run(command))
    return parser


def _lifetime(parser: argparse.ArgumentParser) -> None:
    expiry = parser.add_mutually_exclusive_group()
    expiry.add_argument("--ttl", type=int, help="sliding time-to-live in seconds")
    expiry.add_argument("--expires-at", help="absolute expiry, RFC 3339 (e.g. 2030-01-01T00:00:00Z)")


def register(commands: argparse._SubParsersAction[Any]) -> None:
    base = commands._parser_class  # the main parser's class (its error format), intermixed
    commands._parser_class = type("IntermixedParser", (_Intermixed, base), {})
    try:
        _register(commands)
    finally:
        commands._parser_class = base


def _register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = _add(commands, "ls", ls, "list the streams whose paths start with PREFIX", positional="prefix")
    parser.add_argument("prefix", nargs="?", default="", metavar="PREFIX", help="[default: every stream]")
    parser.add_argument("-l", "--long", action="store_true", help="status, bytes, created, type, path")
    parser.add_argument("--limit", type=int, help="list at most this many [default: all, page after page]")
    parser.description = (
        "List the streams whose paths start with PREFIX (GET <url>/__ds/streams, a page of 1,000 at a "
        "time): one path a line, --long, or --json (one object a line). With a token, only the "
        "streams it may read."
    )

    _add(commands, "info", info, "show a stream's content type, next offset, closure, TTL/expiry")

    parser = _add(commands, "cat", cat, "print a stream from an offset to its current end", json_output=False)
    parser.add_argument("--offset", default="-1", help="where to start (-1: the beginning) [default: -1]")
    parser.add_argument(
        "--json-lines", action="store_true", help="JSON streams: one message per line (else one array)"
    )

    parser = _add(
        commands, "tail", tail, "follow a stream live (SSE) until it is closed or Ctrl-C", json_output=False
    )
    parser.add_argument("--offset", default="now", help="where to start: now, -1 or an offset [default: now]")

    parser = _add(commands, "append", append, "append DATA arguments (else stdin); print the new offset")
    parser.add_argument(
        "data", nargs="*", metavar="DATA", help="joined by newlines; JSON streams: one message each"
    )
    parser.add_argument("--content-type", help="default: the stream's (asked with HEAD)")
    parser.add_argument("--close", action="store_true", help="close the stream with this append")
    parser.add_argument("--producer-id", help="idempotent producer: a retry of the same seq is dropped")
    parser.add_argument("--epoch", type=int, help="producer epoch [default: 0]")
    parser.add_argument("--seq", type=int, help="producer sequence number of this append [default: 0]")

    parser = _add(commands, "create", create, "create a stream (200 and no change if it exists alike)")
    parser.add_argument("data", nargs="*", metavar="DATA", help="initial content (not read from stdin)")
    parser.add_argument("--content-type", help=f"[default: {DEFAULT_CONTENT_TYPE}]")
    parser.add_argument("--closed", action="store_true", help="create it closed (DATA is all it holds)")
    _lifetime(parser)

    _add(commands, "close", close, "close a stream: no appends after this")
    _add(commands, "rm", rm, "delete a stream")

    parser = _add(commands, "fork", fork, "create stream NEW holding SRC's data up to an offset")
    parser.add_argument("--from", dest="source", required=True, metavar="SRC", help="the source stream")
    parser.add_argument("--offset", help="where NEW diverges [default: SRC's tail]")
    parser.add_argument("--content-type", help="must be SRC's [default: SRC's]")
    _lifetime(parser)
