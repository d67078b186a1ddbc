"""The front door, byte for byte: the same raw bytes sent to two gateways on one Redis, one with
fast appends (http/fastpath.py) and one without (aiohttp's path alone), must be answered alike
(status classes, the connection kept or closed), promptly (never a 5xx, never a hang), and
must leave in the stream exactly what was acknowledged: each 2xx append's body once, in order,
nothing of a refused one, nothing smuggled. A battery of hand-written oddities, then
property-based fuzzing (hypothesis), then a probe of how long one hostile request holds the
gateway's event loop.

The gateways run in an event loop of their own, in a thread: the tests are plain functions on
blocking sockets (so hypothesis drives them as it drives any function), and the loop-lag probe
is a task in the gateways' loop. Every read is bounded (``WAIT``). After the bytes of a case the
client reads as many answers as they hold requests, or up to the close (none within ``WAIT``:
the door held them, though the client sent all); then it sends a GET of a stream of its own
(the "probe", whose answer it knows) on the same connection: the probe's answer says the
connection stayed open and no answer more was coming (one more before it: a request smuggled
in), the close says it was closed; no case waits out a timeout to tell.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gateway.protocol import offsets

from .conftest import start_gateway

WAIT: Final = 5.0  # seconds any one exchange may take: past it, a hang
QUIET: Final = 2.0  # fuzzing: seconds without the probe's answer before the client half-closes
PREFIX: Final = "/v1/stream/"
# In the bytes of a case, the stream's path: as long as every path create() makes, so that a
# Content-Length or chunk size counted over bytes holding it stays right.
_PATH: Final = b"/v1/stream/{stream-name}"
HOST: Final = b"Host: 127.0.0.1\r\n"
TEXT: Final = b"Content-Type: text/plain\r\n"
JSON_TYPE: Final = b"Content-Type: application/json\r\n"
# The largest body the fast door holds whole before answering (fastpath.MAX_BODY_BYTES today).
FAST_BODY_BYTES: Final = 256 * 1024

# The gateways' own background tasks (the index sweep's jitter, ...) use the random module in
# their thread while hypothesis draws an example here, which it takes for a strategy's doing.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")


# -- the gateways ---------------------------------------------------------------------------


class Gateways:
    """Two gateways on one Redis (fast appends on, ``fast``; off, ``full``), served by an event
    loop in a thread of their own."""

    def __init__(self, redis_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="front-door", daemon=True)
        self.thread.start()
        self.servers: dict[str, TestServer] = {
            "fast": self.run(start_gateway(redis_url)),
            "full": self.run(start_gateway(redis_url, fast_appends=False)),
        }
        self.probes = {door: self._probe_stream(door) for door in self.servers}

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def port(self, door: str) -> int:
        port = self.servers[door].port
        assert port is not None
        return port

    def close(self) -> None:
        for server in self.servers.values():
            self.run(server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    # -- plain HTTP, for what is not under test: creating and reading streams

    def _http(self, door: str, method: str, path: str, body: bytes = b"", **headers: str) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", self.port(door), timeout=WAIT)
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.headers, response.read()
        finally:
            conn.close()

    def create(self, door: str, media: str = "text/plain") -> str:
        """A fresh stream: its path (as long as _PATH)."""
        path = f"{PREFIX}fd{uuid.uuid4().hex[:11]}"
        status, _, _ = self._http(door, "PUT", path, **{"Content-Type": media})
        assert status == 201, status
        return path

    def stored(self, door: str, path: str) -> bytes | list[Any]:
        """A stream's whole content (a JSON stream's: its messages), read as any client reads."""
        data, messages, offset = b"", [], "-1"
        for _ in range(1000):
            status, headers, body = self._http(door, "GET", f"{path}?offset={offset}")
            assert status == 200, (status, body)
            if headers["Content-Type"].startswith("application/json"):
                messages += json.loads(body)
            else:
                data += body
            offset = headers["Stream-Next-Offset"]
            if headers.get("Stream-Up-To-Date") == "true":
                return messages if headers["Content-Type"].startswith("application/json") else data
        raise AssertionError("the read never got up to date")

    def _probe_stream(self, door: str) -> tuple[bytes, bytes]:
        """The probe: a GET of a stream of its own, and the body that answers it."""
        path, marker = self.create(door), f"probe-{uuid.uuid4().hex}".encode()
        status, _, _ = self._http(door, "POST", path, marker, **{"Content-Type": "text/plain"})
        assert status == 204, status
        return f"GET {path}?offset=-1 HTTP/1.1\r\n".encode() + HOST + b"\r\n", marker

    # -- the loop-lag probe

    def lag_during(self, act: Callable[[], object]) -> float:
        """The longest the gateways' loop was held (seconds past a 1 ms sleep) while ``act`` ran."""
        stop, started = threading.Event(), threading.Event()

        async def probe() -> float:
            worst = 0.0
            while not stop.is_set():
                before = time.perf_counter()
                await asyncio.sleep(0.001)
                worst = max(worst, time.perf_counter() - before - 0.001)
                started.set()
            return worst

        future = asyncio.run_coroutine_threadsafe(probe(), self.loop)
        assert started.wait(5)
        try:
            act()
        finally:
            stop.set()
        return float(future.result(10))


DOORS: Final = ("fast", "full")


@pytest.fixture(scope="module")
def gateways(redis_url: str) -> Iterator[Gateways]:
    pair = Gateways(redis_url)
    yield pair
    pair.close()


# -- one connection, blocking, every wait bounded ----------------------------------------------


class Hang(Exception):
    """Nothing came within the deadline."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


class Client:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # pieces leave as sent
        self.buf = bytearray()
        self.eof = False
        self.received = bytearray()  # everything, for reports

    def send(self, data: bytes) -> bool:
        """False once the server has closed (what it answered before is still to read)."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def shut(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()

    def _more(self, deadline: float) -> bool:
        if self.eof:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise Hang
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(1 << 16)
        except TimeoutError:
            raise Hang from None
        except ConnectionResetError:  # closed with bytes of ours unread: a close all the same
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        self.received += chunk
        return True

    def _line(self, deadline: float) -> bytes | None:
        while (i := self.buf.find(b"\r\n")) < 0:
            if not self._more(deadline):
                return None
        line = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return line

    def _exactly(self, n: int, deadline: float) -> bytes | None:
        while len(self.buf) < n:
            if not self._more(deadline):
                return None
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def answer(self, deadline: float) -> Answer | None:
        """The next response (an interim 1xx included); None if the connection closed first."""
        status_line = self._line(deadline)
        if status_line is None:
            return None
        match = re.match(rb"HTTP/\d\.\d (\d{3}) ", status_line)  # (aiohttp echoes 2.0)
        assert match, f"not a status line: {status_line!r}"
        headers: dict[str, str] = {}
        while line := self._line(deadline):
            name, _, value = line.partition(b":")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if line is None:
            return None
        status = int(match[1])
        body: bytes | None = b""
        if status < 200 or status in (204, 304):
            pass
        elif "content-length" in headers:
            body = self._exactly(int(headers["content-length"]), deadline)
        elif "chunked" in headers.get("transfer-encoding", ""):
            body = self._dechunk(deadline)
        else:  # delimited by the close
            while self._more(deadline):
                pass
            body, self.buf = bytes(self.buf), bytearray()
        return None if body is None else Answer(status, headers, body)

    def _dechunk(self, deadline: float) -> bytes | None:
        body = b""
        while (size_line := self._line(deadline)) is not None:
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while self._line(deadline):  # trailers, up to the blank line
                    pass
                return body
            chunk = self._exactly(size + 2, deadline)
            if chunk is None:
                return None
            body += chunk[:-2]
        return None


# -- an exchange --------------------------------------------------------------------------------

AWAIT_100: Final = "await 100"  # a step: read the interim answer (100 Continue) before going on
Step = bytes | float | str  # bytes to send, seconds to sleep, or AWAIT_100


@dataclass
class Outcome:
    answers: list[Answer] = field(default_factory=list)  # final answers, in order
    interim: list[int] = field(default_factory=list)  # 1xx statuses
    closed: bool = False  # the server closed the connection (else: the probe was answered on it)
    hung: bool = False  # neither the probe's answer nor a close came within WAIT
    held: bool = False  # the answers expected came only after more bytes (the probe)
    waited: bool = False  # fuzzing: nothing for QUIET seconds, so the client half-closed
    stored: bytes | list[Any] = b""
    received: bytes = b""

    @property
    def statuses(self) -> list[int]:
        return [a.status for a in self.answers]

    def agreed(self) -> tuple[object, ...]:
        """What both doors must share."""
        statuses = [s // 100 for s in self.statuses]
        return (statuses, bool(self.interim), self.closed, self.hung, self.held, self.stored)

    def __str__(self) -> str:
        state = "hung" if self.hung else "closed" if self.closed else "kept open"
        state += " (held: answered only once the probe's bytes came)" if self.held else ""
        waited = " (after the client half-closed)" if self.waited else ""
        interim = f" interim {self.interim}" if self.interim else ""
        return f"answers {self.statuses}{interim}, {state}{waited}, stored {self.stored!r}"


def exchange(
    port: int,
    steps: Sequence[Step],
    probe: tuple[bytes, bytes] | None,
    *,
    expect: int | None = None,
    patience: float = WAIT,
    quiet: float | None = None,
) -> Outcome:
    """``steps`` on one new connection; then, with ``expect``, its answers until that many or
    the close (none for ``patience`` seconds: ``held``); then the probe (None: the client
    half-closes instead) and every answer up to the probe's, or the close. With ``quiet``: no
    probe answer for that long and the client half-closes, then reads on to the close (a
    server still waiting for bytes the client promised then closes)."""
    out, client = Outcome(), Client(port)
    deadline = time.monotonic() + WAIT

    def take(answer: Answer | None) -> bool:
        """Whether the exchange goes on after ``answer``."""
        if answer is None:
            out.closed = True
            return False
        if answer.status < 200:
            out.interim.append(answer.status)
        elif probe is not None and answer.status == 200 and answer.body == probe[1]:
            return False
        else:
            out.answers.append(answer)
        return True

    try:
        for step in steps:
            if isinstance(step, bytes):
                if not client.send(step):
                    break
            elif isinstance(step, float):
                time.sleep(step)
            else:  # AWAIT_100
                answer = client.answer(deadline)
                if not take(answer):
                    return out
                if answer is not None and answer.status >= 200:  # a final answer: no body then
                    break
        if expect is not None:
            deadline = time.monotonic() + patience
            try:
                while len(out.answers) < expect and take(client.answer(deadline)):
                    pass
            except Hang:
                out.held = True
            if out.closed:
                return out
        if probe is None:
            client.shut()
        else:
            client.send(probe[0])
        deadline = time.monotonic() + (WAIT if quiet is None else quiet)
        while True:
            try:
                if not take(client.answer(deadline)):
                    break
            except Hang:
                if quiet is None or out.waited:
                    raise
                out.waited = True
                client.shut()
                deadline = time.monotonic() + WAIT
    except Hang:
        out.hung = True
    finally:
        client.close()
        out.received = bytes(client.received)
    return out


# -- what was acknowledged ----------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    """One request of a case as the client meant it: ``append`` (``body`` is stored if it is
    acknowledged), ``read`` (a GET of the stream from the start: a 2xx shows exactly what was
    acknowledged before it), or ``junk`` (no request anyone may acknowledge)."""

    kind: str
    body: bytes = b""


def A(body: bytes) -> Req:
    return Req("append", body)


READ: Final = Req("read")
JUNK: Final = Req("junk")


def json_entries(bodies: Sequence[bytes]) -> list[Any]:
    entries: list[Any] = []
    for body in bodies:
        value = json.loads(body)
        entries += value if isinstance(value, list) else [value]
    return entries


def position(answer: Answer) -> int | None:
    token = answer.headers.get("stream-next-offset")
    return None if token is None else offsets.decode(token)


def judged(out: Outcome, requests: Sequence[Req], media: str = "text/plain") -> list[str]:
    """What is wrong with one door's outcome on its own."""
    problems = []
    if out.hung:
        problems.append(f"after {len(out.answers)} answers, neither the close nor the probe's in {WAIT:g} s")
    if out.held:
        problems.append(f"not all answered within {WAIT:g} s: held until more bytes came")
    if any(s >= 500 for s in out.statuses):
        problems.append(f"a 5xx: {out.statuses}")
    if len(out.answers) > len(requests):
        problems.append(f"{len(out.answers)} answers to {len(requests)} requests: one was smuggled")
    acked: list[bytes] = []
    for n, (answer, req) in enumerate(zip(out.answers, requests, strict=False)):
        if answer.status // 100 != 2:
            continue
        if req.kind == "junk":
            problems.append(f"answer {n}: {answer.status} to bytes that are no request to acknowledge")
        elif req.kind == "append":
            acked.append(req.body)
            at = position(answer)
            if media == "text/plain" and at != len(b"".join(acked)):
                problems.append(f"answer {n}: acknowledged up to {at}, not {len(b''.join(acked))}")
        elif req.kind == "read":
            seen: object = json.loads(answer.body) if media != "text/plain" else answer.body
            if seen != (json_entries(acked) if media != "text/plain" else b"".join(acked)):
                problems.append(f"answer {n}: a read saw {seen!r}, not what was acknowledged before it")
    expected = json_entries(acked) if media != "text/plain" else b"".join(acked)
    if out.stored != expected:
        problems.append(f"stored {out.stored!r}, acknowledged {expected!r}")
    return problems


# -- the battery ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """Bytes (``_PATH`` stands for the stream's path) sent in ``steps``, the ``requests`` they
    hold; ``shut``: the client half-closes after them (else the probe follows), and when they
    are whole requests, each is answered before the close."""

    steps: tuple[Step, ...]
    requests: tuple[Req, ...]
    media: str = "text/plain"
    shut: bool = False
    whole: bool = True


def post(
    body: bytes, *fields: bytes, length: bool = True, ct: bytes = TEXT, line: bytes | None = None
) -> bytes:
    """A POST to the stream: ``fields`` are whole lines, CRLF-terminated."""
    head = (line or b"POST /v1/stream/{stream-name} HTTP/1.1") + b"\r\n" + HOST + ct + b"".join(fields)
    if length:
        head += b"Content-Length: %d\r\n" % len(body)
    return head + b"\r\n" + body


def chunked(body: bytes, *fields: bytes, te: bytes = b"chunked", ct: bytes = TEXT) -> bytes:
    """A POST whose ``body`` is already chunk-coded."""
    return post(body, b"Transfer-Encoding: " + te + b"\r\n", *fields, length=False, ct=ct)


def get(*fields: bytes) -> bytes:
    return b"GET /v1/stream/{stream-name}?offset=-1 HTTP/1.1\r\n" + HOST + b"".join(fields) + b"\r\n"


def lf(data: bytes) -> bytes:
    return data.replace(b"\r\n", b"\n")


def pieces(data: bytes, *cuts: int, pause: float = 0.02) -> tuple[Step, ...]:
    """``data`` sent in pieces cut at ``cuts``, ``pause`` seconds apart."""
    bounds = [0, *sorted(cuts), len(data)]
    steps: list[Step] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        steps += [data[start:end], pause]
    return tuple(steps[:-1])


def one(
    data: bytes, *requests: Req, media: str = "text/plain", shut: bool = False, whole: bool = True
) -> Case:
    return Case((data,), requests, media, shut, whole)


ABC = post(b"abc")
DEF = post(b"def")
ABC_CHUNKED = b"3\r\nabc\r\n0\r\n\r\n"
SMUGGLED = post(b"SMUGGLED")
# 8,000 tabs and a control byte: llhttp refuses it at once; the old head regex backtracked over it
TABS_THEN_CTL = post(b"abc", b"X-Pad: " + b"\t" * 8000 + b"\x01\r\n")


def padded(total: int) -> bytes:
    """A field line of ``total`` bytes, CRLF included."""
    return b"X-Pad: " + b"p" * (total - 9) + b"\r\n"


def fields(n: int) -> bytes:
    """``n`` field lines besides Host, Content-Type and Content-Length."""
    return b"".join(b"X-F%03d: v\r\n" % i for i in range(n))


BATTERY: dict[str, Case] = {
    # Content-Length
    "cl": one(ABC, A(b"abc")),
    "cl-ows": one(post(b"", b"Content-Length:  3 \t\r\n", length=False) + b"abc", A(b"abc")),
    "cl-leading-zeros": one(post(b"", b"Content-Length: 003\r\n", length=False) + b"abc", A(b"abc")),
    "cl-plus": one(post(b"", b"Content-Length: +3\r\n", length=False) + b"abc", A(b"abc")),
    "cl-minus": one(post(b"", b"Content-Length: -3\r\n", length=False) + b"abc", JUNK),
    "cl-hex": one(post(b"", b"Content-Length: 0x3\r\n", length=False) + b"abc", JUNK),
    "cl-two-numbers": one(post(b"", b"Content-Length: 3 3\r\n", length=False) + b"abc", JUNK),
    "cl-list-same": one(post(b"", b"Content-Length: 3, 3\r\n", length=False) + b"abc", A(b"abc")),
    "cl-empty": one(post(b"", b"Content-Length: \r\n", length=False) + b"abc", JUNK),
    "cl-huge": one(post(b"", b"Content-Length: 99999999999999999999\r\n", length=False) + b"abc", JUNK),
    "cl-nul": one(post(b"", b"Content-Length: 3\x00\r\n", length=False) + b"abc", JUNK),
    "cl-twice-same": one(post(b"abc", b"Content-Length: 3\r\n"), A(b"abc")),
    "cl-twice-different": one(post(b"abc", b"Content-Length: 2\r\n"), JUNK),
    "cl-space-before-colon": one(post(b"", b"Content-Length : 3\r\n", length=False) + b"abc", JUNK),
    "cl-shorter-than-body": one(post(b"abc")[:-3].replace(b": 3", b": 2") + b"abc", A(b"ab"), JUNK),
    "cl-longer-than-body": one(post(b"abc").replace(b": 3", b": 5") + DEF, A(b"abcPO"), JUNK),
    "cl-absent-with-body": one(post(b"", length=False) + b"abc", A(b""), JUNK),
    # Transfer-Encoding
    "te-chunked": one(chunked(b"3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n"), A(b"abcdef")),
    "te-chunked-capitals": one(chunked(ABC_CHUNKED, te=b"Chunked"), A(b"abc")),
    "te-chunked-ows": one(chunked(ABC_CHUNKED, te=b" chunked\t"), A(b"abc")),
    "te-chunk-extension": one(chunked(b"3;name=value\r\nabc\r\n0;x\r\n\r\n"), A(b"abc")),
    "te-chunk-extension-quoted": one(chunked(b'3;n="v w"\r\nabc\r\n0\r\n\r\n'), A(b"abc")),
    "te-chunk-extension-ctl": one(chunked(b"3;n=\x01\r\nabc\r\n0\r\n\r\n"), A(b"abc")),
    "te-trailer": one(chunked(b"3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"), A(b"abc")),
    "te-trailer-content-length": one(chunked(b"3\r\nabc\r\n0\r\nContent-Length: 9\r\n\r\n"), A(b"abc")),
    "te-trailer-obs-fold": one(chunked(b"3\r\nabc\r\n0\r\nX-T: 1\r\n 2\r\n\r\n"), A(b"abc")),
    "te-size-not-hex": one(chunked(b"zz\r\nabc\r\n0\r\n\r\n"), JUNK),
    "te-size-negative": one(chunked(b"-3\r\nabc\r\n0\r\n\r\n"), JUNK),
    "te-size-0x": one(chunked(b"0x3\r\nabc\r\n0\r\n\r\n"), JUNK),
    "te-size-space": one(chunked(b"3 \r\nabc\r\n0\r\n\r\n"), A(b"abc")),
    "te-size-leading-zeros": one(chunked(b"0003\r\nabc\r\n0\r\n\r\n"), A(b"abc")),
    "te-size-huge": one(chunked(b"fffffffffffffffff\r\nabc\r\n0\r\n\r\n"), JUNK),
    "te-size-too-big": one(chunked(b"5\r\nabc\r\n0\r\n\r\n"), JUNK),
    "te-size-too-small": one(chunked(b"2\r\nabc\r\n0\r\n\r\n"), JUNK),
    "te-chunk-lf": one(chunked(b"3\nabc\n0\n\n"), JUNK),
    "te-no-last-chunk": one(chunked(b"3\r\nabc\r\n") + DEF, JUNK, JUNK),
    "te-only-last-chunk": one(chunked(b"0\r\n\r\n"), A(b"")),
    "te-many-chunks": one(
        chunked(b"".join(b"1\r\n%c\r\n" % c for c in b"abcdefghij") + b"0\r\n\r\n"), A(b"abcdefghij")
    ),
    "te-gzip-chunked": one(chunked(ABC_CHUNKED, te=b"gzip, chunked"), JUNK),
    "te-chunked-gzip": one(chunked(ABC_CHUNKED, te=b"chunked, gzip"), JUNK),
    "te-identity": one(post(b"abc", b"Transfer-Encoding: identity\r\n"), JUNK),
    "te-twice": one(chunked(ABC_CHUNKED, b"Transfer-Encoding: chunked\r\n"), JUNK),
    "te-gzip-then-chunked-lines": one(chunked(ABC_CHUNKED, b"Transfer-Encoding: gzip\r\n"), JUNK),
    # (RFC 9112 6.1: framing faulty; processed, the connection is closed after it)
    "te-http-1.0": one(chunked(ABC_CHUNKED).replace(b"HTTP/1.1", b"HTTP/1.0"), A(b"abc")),
    "te-then-append": one(chunked(ABC_CHUNKED) + DEF, A(b"abc"), A(b"def")),
    # both: the classic smuggles, the second request hidden in the first one's body
    # (RFC 9112 lets a server refuse both, or go by Transfer-Encoding alone and then close)
    "cl-and-te": one(chunked(ABC_CHUNKED, b"Content-Length: 13\r\n"), A(b"abc")),
    "te-and-cl-smuggle": one(
        chunked(b"0\r\n\r\n" + SMUGGLED, b"Content-Length: %d\r\n" % (5 + len(SMUGGLED))), A(b"")
    ),
    "cl-and-te-smuggle": one(post(b"0\r\n\r\n" + SMUGGLED, b"Transfer-Encoding: chunked\r\n"), A(b"")),
    "cl-and-te-obs-fold-smuggle": one(
        post(b"0\r\n\r\n" + SMUGGLED, b"X: y\r\n Transfer-Encoding: chunked\r\n"), A(b"0\r\n\r\n" + SMUGGLED)
    ),
    "te-with-space-before-colon-smuggle": one(
        post(b"0\r\n\r\n" + SMUGGLED, b"Transfer-Encoding : chunked\r\n"), A(b"0\r\n\r\n" + SMUGGLED)
    ),
    # obs-fold: a field continued on the next line
    "obs-fold": one(post(b"abc", b"X-A: a\r\n b\r\n"), A(b"abc")),
    "obs-fold-tab": one(post(b"abc", b"X-A: a\r\n\tb\r\n"), A(b"abc")),
    "obs-fold-content-type": one(post(b"abc", ct=b"Content-Type: text/\r\n plain\r\n"), A(b"abc")),
    "obs-fold-content-length": one(post(b"", b"Content-Length: 3\r\n 4\r\n", length=False) + b"abc", JUNK),
    "obs-fold-first-field": one(
        post(b"abc", line=b"POST /v1/stream/{stream-name} HTTP/1.1\r\n X: y"), A(b"abc")
    ),
    # line endings
    "bare-lf-get": one(lf(get()), READ),
    "bare-lf-post": one(lf(ABC), A(b"abc")),
    "bare-lf-one-field": one(post(b"abc", b"X-A: b\n"), A(b"abc")),
    "bare-lf-request-line": one(ABC.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\n"), A(b"abc")),
    "bare-lf-blank-line": one(ABC.replace(b"\r\n\r\nabc", b"\r\n\nabc"), A(b"abc")),
    "bare-cr-line-end": one(post(b"abc", b"X-A: b\r"), A(b"abc")),
    "bare-cr-in-value": one(post(b"abc", b"X-A: b\rc\r\n"), A(b"abc")),
    "cr-cr-lf": one(post(b"abc", b"X-A: b\r\r\n"), A(b"abc")),
    "empty-line-first": one(b"\r\n" + ABC, A(b"abc")),
    "empty-lf-line-first": one(b"\n" + ABC, A(b"abc")),
    # control bytes and whitespace
    **{
        f"ctl-{where}-{byte:02x}": one(post(b"abc", template % bytes([byte])), A(b"abc"))
        for byte in (0x00, 0x01, 0x0B, 0x1B, 0x7F)
        for where, template in (("value", b"X-A: a%sb\r\n"), ("name", b"X-%sA: b\r\n"))
    },
    "ctl-host": one(post(b"abc").replace(b"127.0.0.1", b"127.0.0.1\x00"), A(b"abc")),
    "ctl-method": one(post(b"abc", line=b"PO\x00ST /v1/stream/{stream-name} HTTP/1.1"), JUNK),
    "ctl-target-query": one(post(b"abc", line=b"POST /v1/stream/{stream-name}?x=\x01 HTTP/1.1"), A(b"abc")),
    "ctl-version": one(post(b"abc", line=b"POST /v1/stream/{stream-name} HTTP/1.1\x00"), JUNK),
    "obs-text-value": one(post(b"abc", b"X-A: caf\xc3\xa9 \x80\xff\r\n"), A(b"abc")),
    "tabs-in-value": one(post(b"abc", b"X-A:\ta\t\tb\t \r\n"), A(b"abc")),
    "space-in-name": one(post(b"abc", b"X A: b\r\n"), A(b"abc")),
    "empty-name": one(post(b"abc", b": b\r\n"), A(b"abc")),
    "no-colon": one(post(b"abc", b"X-A b\r\n"), A(b"abc")),
    "space-before-colon": one(post(b"abc", b"X-A : b\r\n"), A(b"abc")),
    "tabs-then-ctl": one(TABS_THEN_CTL, A(b"abc")),
    "spaces-then-ctl": one(TABS_THEN_CTL.replace(b"\t", b" "), A(b"abc")),
    "two-spaces-in-request-line": one(
        post(b"abc", line=b"POST  /v1/stream/{stream-name} HTTP/1.1"), A(b"abc")
    ),
    "lower-case-method": one(post(b"abc", line=b"post /v1/stream/{stream-name} HTTP/1.1"), JUNK),
    # long and many
    "line-8100": one(post(b"abc", padded(8100)), A(b"abc")),
    "line-8190": one(post(b"abc", padded(8190)), A(b"abc")),
    "line-8192": one(post(b"abc", padded(8192)), A(b"abc")),
    "line-16k": one(post(b"abc", padded(16384)), A(b"abc")),
    "lines-of-64k": one(post(b"abc", *[padded(4000)] * 16), A(b"abc")),
    "target-8100": one(
        post(b"abc", line=b"POST /v1/stream/{stream-name}?pad=" + b"q" * 8000 + b" HTTP/1.1"), A(b"abc")
    ),
    "fields-125": one(post(b"abc", fields(125)), A(b"abc")),  # 128 in all
    "fields-126": one(post(b"abc", fields(126)), A(b"abc")),
    "fields-200": one(post(b"abc", fields(200)), A(b"abc")),
    # request targets
    "absolute-form": one(
        post(b"abc", line=b"POST http://127.0.0.1/v1/stream/{stream-name} HTTP/1.1"), A(b"abc")
    ),
    "absolute-form-https": one(
        post(b"abc", line=b"POST https://127.0.0.1/v1/stream/{stream-name} HTTP/1.1"), A(b"abc")
    ),
    "absolute-form-other-host": one(
        post(b"abc", line=b"POST http://evil.example/v1/stream/{stream-name} HTTP/1.1"), A(b"abc")
    ),
    "absolute-form-no-host": one(
        post(b"abc", line=b"POST http://127.0.0.1/v1/stream/{stream-name} HTTP/1.1").replace(HOST, b""),
        A(b"abc"),
    ),
    "authority-form": one(b"CONNECT 127.0.0.1:80 HTTP/1.1\r\n" + HOST + b"\r\n", JUNK),
    "no-host": one(post(b"abc").replace(HOST, b""), A(b"abc")),
    "two-hosts": one(post(b"abc", HOST), A(b"abc")),
    # versions and connections
    "http-1.0": one(post(b"abc", line=b"POST /v1/stream/{stream-name} HTTP/1.0") + DEF, A(b"abc"), A(b"def")),
    "http-1.0-keep-alive": one(
        post(b"abc", b"Connection: keep-alive\r\n", line=b"POST /v1/stream/{stream-name} HTTP/1.0") + DEF,
        A(b"abc"),
        A(b"def"),
    ),
    "http-2.0": one(
        post(b"abc", line=b"POST /v1/stream/{stream-name} HTTP/2.0"), A(b"abc")
    ),  # llhttp takes it
    "connection-close": one(post(b"abc", b"Connection: close\r\n") + DEF, A(b"abc"), A(b"def")),
    # pipelining
    "pipeline-3": one(ABC + DEF + post(b"ghi"), A(b"abc"), A(b"def"), A(b"ghi")),
    "pipeline-with-reads": one(ABC + get() + DEF + get(), A(b"abc"), READ, A(b"def"), READ),
    "pipeline-with-a-query": one(
        ABC + post(b"def", line=b"POST /v1/stream/{stream-name}?x=1 HTTP/1.1") + post(b"ghi"),
        A(b"abc"),
        A(b"def"),
        A(b"ghi"),
    ),
    "pipeline-20": one(
        b"".join(post(b"%02d," % n) for n in range(20)), *[A(b"%02d," % n) for n in range(20)]
    ),
    "pipeline-then-junk": one(ABC + b"junk\r\n\r\n", A(b"abc"), JUNK),
    "pipeline-refused-between": one(ABC + post(b"x", ct=b"") + DEF, A(b"abc"), A(b"x"), A(b"def")),
    # partial and slow
    "slow-head": Case(pieces(ABC, 5, 20, 40, 60), (A(b"abc"),)),
    "head-byte-by-byte": Case(pieces(ABC, *range(1, len(ABC)), pause=0.001), (A(b"abc"),)),
    "split-in-blank-line": Case(pieces(ABC, len(ABC) - 5, len(ABC) - 4), (A(b"abc"),)),
    "slow-body": Case(
        pieces(post(b"abcdef"), len(post(b"abcdef")) - 6, len(post(b"abcdef")) - 3), (A(b"abcdef"),)
    ),
    "body-past-half-a-second": Case(pieces(ABC, len(ABC) - 2, pause=0.7), (A(b"abc"),)),
    "slow-chunks": Case(
        pieces(chunked(ABC_CHUNKED), len(chunked(ABC_CHUNKED)) - 10, len(chunked(ABC_CHUNKED)) - 4),
        (A(b"abc"),),
    ),
    "slow-pipeline": Case(pieces(ABC + DEF, len(ABC) + 10, len(ABC) + 30), (A(b"abc"), A(b"def"))),
    "slow-bare-lf": Case(pieces(lf(ABC), 10, 30), (A(b"abc"),)),
    # Expect: 100-continue
    "expect-with-body": one(post(b"abc", b"Expect: 100-continue\r\n"), A(b"abc")),
    "expect-then-body": Case(
        (post(b"abc", b"Expect: 100-continue\r\n")[:-3], AWAIT_100, b"abc"), (A(b"abc"),)
    ),
    "expect-pipelined": one(post(b"abc", b"Expect: 100-continue\r\n") + DEF, A(b"abc"), A(b"def")),
    "expect-other": one(post(b"abc", b"Expect: something\r\n"), A(b"abc")),
    # half-close: the client's FIN after a whole request; its answer must still come
    "half-close-append": one(ABC, A(b"abc"), shut=True),
    "half-close-pipeline": one(ABC + DEF, A(b"abc"), A(b"def"), shut=True),
    "half-close-read": one(ABC + get(), A(b"abc"), READ, shut=True),
    "half-close-get": one(get(), READ, shut=True),
    "half-close-chunked": one(chunked(ABC_CHUNKED), A(b"abc"), shut=True),
    "half-close-query": one(post(b"abc", line=b"POST " + _PATH + b"?x=1 HTTP/1.1"), A(b"abc"), shut=True),
    "half-close-bare-lf": one(lf(ABC), A(b"abc"), shut=True),
    "half-close-partial-body": one(ABC[:-1], JUNK, shut=True, whole=False),
    "half-close-partial-head": one(ABC[:20], JUNK, shut=True, whole=False),
    # JSON
    "json-pipeline": one(
        post(b'[{"a":1},2]', ct=JSON_TYPE) + post(b'"s"', ct=JSON_TYPE) + get(),
        A(b'[{"a":1},2]'),
        A(b'"s"'),
        READ,
        media="application/json",
    ),
    "json-chunked": one(
        chunked(b"5\r\n[1,2]\r\n0\r\n\r\n", ct=JSON_TYPE), A(b"[1,2]"), media="application/json"
    ),
    "json-malformed": one(
        post(b"{nope", ct=JSON_TYPE) + post(b"[3]", ct=JSON_TYPE), JUNK, A(b"[3]"), media="application/json"
    ),
}


def report(case_bytes: bytes, outcomes: dict[str, Outcome], problems: Sequence[str]) -> str:
    lines = [*problems, f"bytes sent: {case_bytes!r}"]
    for door, out in outcomes.items():
        lines.append(f"{door}: {out}")
        lines.append(f"{door} received: {out.received[:600]!r}")
    return "\n".join(lines)


def resolved(steps: Sequence[Step], path: bytes) -> list[Step]:
    """``steps`` with ``_PATH`` replaced by ``path``, cut where they were (a cut within
    ``_PATH`` as far into the path)."""
    data = b"".join(s for s in steps if isinstance(s, bytes))
    starts = [m.start() for m in re.finditer(re.escape(_PATH), data)]
    whole, grow = data.replace(_PATH, path), len(path) - len(_PATH)
    result: list[Step] = []
    done = at = 0  # where the pieces so far end, in whole and in data
    for step in steps:
        if isinstance(step, bytes):
            at += len(step)
            upto = at + grow * sum(1 for s in starts if s + len(_PATH) <= at)
            result.append(whole[done:upto])
            done = upto
        else:
            result.append(step)
    return result


def generic(out: Outcome, stored: bytes | list[Any], path: bytes) -> Outcome:
    """``out`` with what the stream holds, the stream's path in both as ``_PATH`` (what two
    doors' streams hold compares, whatever their names)."""
    out.stored = stored.replace(path, _PATH) if isinstance(stored, bytes) else stored
    for answer in out.answers:
        answer.body = answer.body.replace(path, _PATH)
    return out


def play(gateways: Gateways, door: str, case: Case) -> Outcome:
    path = gateways.create(door, case.media)
    steps = resolved(case.steps, path.encode())
    if case.shut:
        out = exchange(gateways.port(door), steps, None)
    else:
        out = exchange(gateways.port(door), steps, gateways.probes[door], expect=len(case.requests))
    return generic(out, gateways.stored(door, path), path.encode())


@pytest.mark.parametrize("name", list(BATTERY))
def test_both_doors_answer_alike_and_store_what_they_acknowledge(gateways: Gateways, name: str) -> None:
    case = BATTERY[name]
    outcomes = {door: play(gateways, door, case) for door in DOORS}
    problems = [
        f"{door}: {p}" for door, out in outcomes.items() for p in judged(out, case.requests, case.media)
    ]
    for door, out in outcomes.items():
        if case.shut and case.whole and len(out.answers) < len(case.requests):
            problems.append(f"{door}: closed after the client's FIN with requests unanswered")
    if outcomes["fast"].agreed() != outcomes["full"].agreed():
        problems.append("the doors disagree")
    sent = b"".join(s for s in case.steps if isinstance(s, bytes))
    assert not problems, report(sent, outcomes, problems)


# -- the known defects, one test each ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["get", "post"])
def test_bare_line_feeds_are_answered_promptly(gateways: Gateways, kind: str) -> None:
    """A head whose lines end in LF alone is answered (as aiohttp's path answers it) at once,
    not held as an unfinished head until the keep-alive timeout."""
    data = lf(get()) if kind == "get" else lf(ABC)
    outcomes = {}
    for door in DOORS:
        path = gateways.create(door)
        client = Client(gateways.port(door))
        client.send(data.replace(_PATH, path.encode()))
        try:
            answer = client.answer(time.monotonic() + 2)
            outcomes[door] = "closed" if answer is None else answer.status // 100
        except Hang:
            outcomes[door] = "nothing within 2 s"
        finally:
            client.close()
    assert outcomes["fast"] == outcomes["full"], outcomes


@pytest.mark.parametrize("door", DOORS)
def test_an_append_then_the_clients_fin_is_answered(gateways: Gateways, door: str) -> None:
    """A whole append, then the client shuts its write side: the answer still comes (a 2xx),
    then the close; the body is stored once."""
    path = gateways.create(door)
    out = exchange(gateways.port(door), [ABC.replace(_PATH, path.encode())], None)
    out.stored = gateways.stored(door, path)
    assert [s // 100 for s in out.statuses] == [2], str(out)
    assert out.closed, f"answered, then not closed within {WAIT:g} s: {out}"
    assert out.stored == b"abc", str(out)


# -- no request holds the loop -------------------------------------------------------------------------

# The limit is 10 ms; 25 ms leaves room for a loaded 2-core CI machine (the probe's own timer
# and GIL hand-offs), far below the 230-350 ms the old head regex spent on TABS_THEN_CTL.
LAG_LIMIT: Final = 0.025


def hostile(gateways: Gateways, door: str, kind: str) -> tuple[Callable[[], object], Callable[[], None]]:
    """What to send (built before the measurement), and a check of its answers after."""
    media = "application/json" if kind.startswith("json") else "text/plain"
    path = gateways.create(door, media).encode()
    port, outcomes = gateways.port(door), []
    if kind == "json-256k":  # the largest body the fast door takes whole: thousands of entries
        entry = b'{"n":123456,"text":"' + b"x" * 80 + b'"}'
        count = (FAST_BODY_BYTES - 2) // (len(entry) + 1) - 1
        body = b"[" + b",".join([entry] * count) + b"]"
        data = [post(body, ct=JSON_TYPE).replace(_PATH, path)]
    elif kind == "json-256k-tiny":  # as large, of the smallest entries: 131,071 of them
        body = b"[" + b",".join([b"1"] * ((FAST_BODY_BYTES - 2) // 2)) + b"]"
        data = [post(body, ct=JSON_TYPE).replace(_PATH, path)]
    elif kind == "128-fields":  # 128 fields in all, 60 bytes each
        lines = [b"X-F%03d: " % i + b"v" * 50 + b"\r\n" for i in range(125)]
        data = [post(b"abc", *lines).replace(_PATH, path)]
    else:
        data = [TABS_THEN_CTL.replace(_PATH, path)] * (8 if kind == "8-tab-heads" else 1)

    def act() -> None:
        clients = [Client(port) for _ in data]  # 8 heads: 8 connections, sent at once
        try:
            for client, chunk in zip(clients, data, strict=True):
                client.send(chunk)
            deadline = time.monotonic() + 30  # measured, not judged here: a hog answers late
            for client in clients:
                answer = client.answer(deadline)
                outcomes.append(None if answer is None else answer.status)
        finally:
            for client in clients:
                client.close()

    def check() -> None:
        assert outcomes and all(s is not None and s < 500 for s in outcomes), outcomes
        if kind != "tab-line" and kind != "8-tab-heads":
            assert all(s // 100 == 2 for s in outcomes if s is not None), outcomes

    return act, check


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(
    "kind",
    [
        "tab-line",
        "8-tab-heads",
        "128-fields",
        "json-256k",
        # 131,071 entries split on the loop held it 80-90 ms before JSON bodies over 16 KiB
        # went to a thread (handlers._PARSE_INLINE_BYTES)
        "json-256k-tiny",
    ],
)
def test_no_request_holds_the_event_loop(gateways: Gateways, door: str, kind: str) -> None:
    """A probe task in the gateways' loop sleeps 1 ms over and over while a hostile request is
    served; the longest it overslept is the longest the loop was held. A hog reproduces every
    time, noise does not: up to 3 tries, the smallest counts."""
    lags = []
    for _ in range(3):
        act, check = hostile(gateways, door, kind)
        lags.append(gateways.lag_during(act))
        check()
        if lags[-1] < LAG_LIMIT:
            break
    assert min(lags) < LAG_LIMIT, f"the loop was held {[f'{lag * 1000:.1f} ms' for lag in lags]}"


# -- fuzzing ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Framed:
    method: bytes
    target: bytes
    body: bytes


_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_REQUEST_LINE = re.compile(rb"(GET|POST) (/[!-~]*) HTTP/1\.1")
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,8})((?:;" + _TOKEN + rb"(?:=" + _TOKEN + rb")?)*)")


def frame(data: bytes) -> tuple[list[Framed], bool, int]:
    """The reference: the messages in ``data`` as far as HTTP/1.1 frames them beyond doubt
    (plain CRLF heads, token names, visible values, one Content-Length of digits or
    Transfer-Encoding: chunked with plain chunks); whether that reaches the end of ``data``;
    and how many bytes the last message still lacks of its Content-Length (0: none)."""
    messages: list[Framed] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            return messages, False, 0
        request_line, *lines = data[pos:end].split(b"\r\n")
        matched = _REQUEST_LINE.fullmatch(request_line)
        if matched is None or any(b"\r" in line or b"\n" in line for line in lines):
            return messages, False, 0
        lengths, codings = [], []
        for line in lines:
            name, colon, value = line.partition(b":")
            value = value.strip(b" \t")
            if not colon or not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
                return messages, False, 0
            if name.lower() == b"content-length":
                lengths.append(value)
            elif name.lower() == b"transfer-encoding":
                codings.append(value)
        start = end + 4
        if len(lengths) + len(codings) > 1:
            return messages, False, 0
        if codings:
            if codings[0].lower() != b"chunked":
                return messages, False, 0
            body, after = b"", start
            while True:
                line_end = data.find(b"\r\n", after)
                size_line = _CHUNK_SIZE.fullmatch(data[after:line_end]) if line_end >= 0 else None
                if size_line is None:
                    return messages, False, 0
                size, after = int(size_line[1], 16), line_end + 2
                if size == 0:
                    break
                if data[after + size : after + size + 2] != b"\r\n":
                    return messages, False, 0
                body, after = body + data[after : after + size], after + size + 2
            while (line_end := data.find(b"\r\n", after)) > after:  # trailer fields
                name, colon, value = data[after:line_end].partition(b":")
                if not colon or not _NAME.fullmatch(name) or not _VALUE.fullmatch(value.strip(b" \t")):
                    return messages, False, 0
                after = line_end + 2
            if line_end < 0:
                return messages, False, 0
            pos = line_end + 2
        elif lengths:
            if not lengths[0].isdigit() or len(lengths[0]) > 15:
                return messages, False, 0
            pos = start + int(lengths[0])
            if pos > len(data):
                return messages, False, pos - len(data)
            body = data[start:pos]
        else:
            body, pos = b"", start
        messages.append(Framed(matched[1], matched[2], body))
    return messages, True, 0


_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_ODD = [b"\x00", b"\x01", b"\x7f", b"\x0b", b"\x1b", b"\r", b"\n", b"\t", b" ", b"\x80", b"\xff", b":"]


@st.composite
def field_values(draw: st.DrawFn) -> bytes:
    parts = draw(
        st.lists(
            st.one_of(
                st.text(_ALPHABET, min_size=1, max_size=6).map(str.encode),
                st.sampled_from(_ODD),
                st.tuples(st.sampled_from([b" ", b"\t"]), st.integers(1, 40)).map(lambda t: t[0] * t[1]),
            ),
            max_size=5,
        )
    )
    return b"".join(parts)


@st.composite
def field_names(draw: st.DrawFn) -> bytes:
    name = draw(st.sampled_from([b"X-A", b"Accept", b"User-Agent", b"X-Trace", b"Content-Language"]))
    if draw(st.integers(0, 5)) == 0:  # a byte no name may hold, somewhere in it
        at = draw(st.integers(0, len(name)))
        name = name[:at] + draw(st.sampled_from(_ODD)) + name[at:]
    return name


@st.composite
def fuzz_requests(draw: st.DrawFn, index: int, eol: bytes | None) -> bytes:
    """A mutation of a plain append (or now and then of a read); its lines end in ``eol``
    (``b"mixed"``: each as it comes; None: one drawn here)."""
    body = b"<%d>" % index + draw(st.text(_ALPHABET, max_size=20)).encode()
    if draw(st.integers(0, 9)) == 0:
        body = b""
    elif draw(st.integers(0, 9)) == 0:  # a whole request hidden in the body, as smuggles do
        body = b"0\r\n\r\n" + post(b"SMUGGLED%d" % index)
    line = draw(
        st.sampled_from(
            [b"POST /v1/stream/{stream-name} HTTP/1.1"] * 8
            + [
                b"GET /v1/stream/{stream-name}?offset=-1 HTTP/1.1",
                b"POST /v1/stream/{stream-name} HTTP/1.0",
                b"POST http://127.0.0.1/v1/stream/{stream-name} HTTP/1.1",
            ]
            + [
                b"post /v1/stream/{stream-name} HTTP/1.1",
                b"POST  /v1/stream/{stream-name} HTTP/1.1",
                b"POST /v1/stream/{stream-name}  HTTP/1.1",
            ]
        )
    )
    head = [HOST[:-2], TEXT[:-2]]
    head += [
        name + b":" + draw(st.sampled_from([b" ", b"", b"\t"])) + value
        for name, value in draw(st.lists(st.tuples(field_names(), field_values()), max_size=3))
    ]
    framing = draw(
        st.sampled_from(["cl"] * 6 + ["cl-off", "cl-odd", "cl-twice", "te", "te-odd", "te+cl", "none"])
    )
    n = len(body)
    if framing == "cl":
        head.append(b"Content-Length: %d" % n)
    elif framing == "cl-off":
        head.append(b"Content-Length: %d" % max(0, n + draw(st.integers(-4, 4))))
    elif framing == "cl-odd":
        odd = draw(
            st.sampled_from([b"+%d", b" %d ", b"0%d", b"%d,%d", b"%d, %d", b"-%d", b"", b"%d %d", b"%d\x00"])
        )
        head.append(b"Content-Length: " + (odd % ((n,) * odd.count(b"%d"))))
    elif framing == "cl-twice":
        head += [b"Content-Length: %d" % n, b"Content-Length: %d" % (n + draw(st.integers(0, 1)))]
    if framing in ("te", "te-odd", "te+cl"):
        cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3))) if n > 1 else []
        bounds = [0, *cuts, n]
        extension = draw(st.sampled_from([b""] * 4 + [b";a=b", b";a", b';a="q"', b" ", b";\x01"]))
        chunks = [
            b"%x%s\r\n%s\r\n" % (e - s, extension, body[s:e])
            for s, e in zip(bounds, bounds[1:], strict=False)
            if e > s
        ]
        trailer = draw(
            st.sampled_from([b""] * 4 + [b"X-T: 1\r\n", b"Content-Length: 9\r\n", b"X-T: \x00\r\n"])
        )
        coded = b"".join(chunks) + b"0\r\n" + trailer + b"\r\n"
        if framing == "te-odd":
            coded = coded.replace(b"\r\n", draw(st.sampled_from([b"\n", b"\r\n"])), draw(st.integers(1, 3)))
        coding = (
            b"chunked"
            if framing != "te-odd"
            else draw(
                st.sampled_from(
                    [b"Chunked", b"gzip, chunked", b"chunked, gzip", b" chunked", b"chunked, chunked"]
                )
            )
        )
        head.append(b"Transfer-Encoding: " + coding)
        if framing == "te+cl":
            head.append(b"Content-Length: %d" % draw(st.sampled_from([n, len(coded), 0])))
        body = coded
    head = draw(st.permutations(head))
    if draw(st.integers(0, 7)) == 0:  # obs-fold: a line continued
        at = draw(st.integers(0, len(head)))
        head.insert(at, draw(st.sampled_from([b" folded", b"\tfolded", b" "])))
    if eol is None:
        eol = draw(st.sampled_from([b"\r\n"] * 7 + [b"\n", b"mixed"]))
    if eol == b"mixed":
        ends = [draw(st.sampled_from([b"\r\n", b"\r\n", b"\n", b"\r"])) for _ in range(len(head) + 2)]
    else:
        ends = [eol] * (len(head) + 2)
    lines = [line, *head, b""]
    return b"".join(text + end for text, end in zip(lines, ends, strict=False)) + body


@st.composite
def fuzz_cases(draw: st.DrawFn) -> tuple[bytes, tuple[int, ...]]:
    """1-3 requests back to back, and where to cut them into pieces (none: one write)."""
    # Line ends chosen per request, or one for all (a head held for want of CRLF CRLF is
    # held only while no later request's head brings one).
    eol = draw(st.sampled_from([None] * 5 + [b"\n", b"mixed"]))
    data = b"".join(draw(fuzz_requests(i, eol)) for i in range(draw(st.integers(1, 3))))
    cuts = draw(st.sets(st.integers(1, len(data) - 1), max_size=3)) if draw(st.booleans()) else set()
    return data, tuple(sorted(cuts))


def judged_fuzz(
    out: Outcome, messages: list[Framed], whole: bool, path: bytes, probe_path: bytes
) -> list[str]:
    """One door's outcome against the reference framing (``whole``: it frames every byte)."""
    problems = []
    if out.hung:
        problems.append(f"no answer and no close within {WAIT:g} s after the client half-closed")
    if any(s >= 500 for s in out.statuses):
        problems.append(f"a 5xx: {out.statuses}")
    if whole and not out.closed and not out.waited and len(out.answers) != len(messages) - 1:
        problems.append(f"{len(out.answers)} answers before the probe's, to {len(messages) - 1} requests")
    acked, unverified = b"", False
    assert isinstance(out.stored, bytes)
    for n, answer in enumerate(out.answers):
        if answer.status // 100 != 2:
            continue
        message = messages[n] if n < len(messages) else None
        if message is not None and message.target.startswith(probe_path):
            problems.append(f"answer {n}: the probe's request answered out of turn")
        elif message is not None and message.method == b"POST" and message.target == path:
            acked += message.body
            if position(answer) != len(acked):
                problems.append(f"answer {n}: acknowledged up to {position(answer)}, not {len(acked)}")
        elif message is not None and message.method == b"GET" and message.target.startswith(path + b"?"):
            if answer.body != acked:
                problems.append(f"answer {n}: a read saw {answer.body!r}, acknowledged {acked!r}")
        elif message is None and answer.status == 204 and position(answer) is not None:
            # past what the reference frames: what the answer says it stored, taken as it is
            piece = out.stored[len(acked) : position(answer)]
            if re.fullmatch(rb"SMUGGLED\d", piece):
                problems.append(f"answer {n}: stored {piece!r}, a request hidden in another's body")
            acked += piece
            unverified = True
    if out.stored != acked:
        what = "answers past the reference" if unverified else "the requests framed"
        problems.append(f"stored {out.stored!r}, acknowledged {acked!r} ({what})")
    return problems


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI reproduces any failure
    database=None,
    # No shrinking: a step that hangs costs QUIET + WAIT seconds, so shrinking one could take
    # minutes; a failure prints its bytes whole, and derandomize brings it back.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(case=fuzz_cases())
def test_fuzzed_requests_never_lose_smuggle_or_hang(
    gateways: Gateways, case: tuple[bytes, tuple[int, ...]]
) -> None:
    """Mutated appends (1-3, in one write or in pieces) on both doors: never a 5xx, an answer
    or a close in time, and the stream holds exactly the acknowledged bodies as the reference
    frames them (``frame``); past what it frames beyond doubt, each acknowledged append is
    taken as its answer's offset says, and none may be a request hidden in another's body."""
    template, cuts = case
    outcomes: dict[str, Outcome] = {}
    problems: list[str] = []

    def run(door: str, expect: int | None) -> Outcome:
        path = gateways.create(door).encode()
        probe, marker = gateways.probes[door]
        messages, whole, lacking = frame(template + probe)  # (paths as long as _PATH: framed alike)
        finish = probe
        if lacking:  # the last body is short of its length: the promised bytes, then the probe
            finish = probe + b"~" * lacking + probe
            messages, whole, _ = frame(template + finish)
        data = template.replace(_PATH, path)
        steps = pieces(data, *cuts, pause=0.01) if cuts else (data,)
        out = exchange(
            gateways.port(door), steps, (finish, marker), expect=expect, patience=QUIET, quiet=QUIET
        )
        out = generic(out, gateways.stored(door, path.decode()), path)
        probe_path = probe.split(b" ")[1].split(b"?")[0]
        problems.extend(f"{door}: {p}" for p in judged_fuzz(out, messages, whole, _PATH, probe_path))
        return out

    # How many answers aiohttp's path gives before the probe (sent at once, here): then both
    # doors alike wait for that many before they get the probe. A door that gives them only
    # once the probe's bytes came (they end its head: CRLF CRLF) held them.
    first = run("full", None)
    expect = None if first.waited else len(first.answers)
    outcomes = {"full": run("full", expect), "fast": run("fast", expect)}
    fast, full = outcomes["fast"], outcomes["full"]
    if fast.held and not full.held:
        problems.append("fast: held answers aiohttp's path gave at once, until more bytes came")
    if fast.waited != full.waited:
        problems.append("only one door waited for more bytes (the client half-closed after 2 s)")
    # In one write, aiohttp's path is deterministic; in pieces, whether a request before a
    # malformed one is answered depends on which read each arrives in.
    if not cuts and fast.agreed() != full.agreed():
        problems.append("the doors disagree")
    assert not problems, report(template, outcomes, problems) + f"\ncuts: {cuts}"
