"""The load a fault run puts on the cluster: writers, live readers, final reads.

Writers append unique records (``history.record``) through any gateway. Plain
writers send each record once and move on whatever the answer; idempotent
producers (``Producer-Id``/``-Epoch``/``-Seq``) retry a record with the SAME
Producer-Seq until it is acknowledged (the server must deduplicate). Every
attempt is logged. Live readers (SSE and long-poll) tail a stream from the
start through any gateway, reconnecting from the last ``Stream-Next-Offset``
(SSE: the ``streamNextOffset`` of the last control event) whenever a
connection ends or fails, until they see the stream close.

Every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from multidict import CIMultiDict

from .history import ACKED, FAILED, Append, Attempt, ReaderLog

PREFIX = "/v1/stream/"
TEXT = {"Content-Type": "text/plain"}
NO_ANSWER = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


@dataclass
class Timing:
    request_timeout: float = 5.0  # an append without an answer by then: outcome unknown
    long_poll_timeout: float = 15.0  # the gateways' --long-poll-timeout
    sse_read_timeout: float = 6.0  # silence (no heartbeat) this long: the connection is dead
    pace: float = 0.04  # a writer sleeps up to this long between appends
    producer_give_up: float = 30.0  # a producer retries one record at most this long
    retry_pause: tuple[float, float] = (0.05, 0.25)


@dataclass
class Stats:
    statuses: Counter[str] = field(default_factory=Counter)  # "append 204", "read 503", ...

    def note(self, what: str, status: int | str) -> None:
        self.statuses[f"{what} {status}"] += 1


class Clock:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.started


Gateways = Callable[[], Sequence[str]]  # base URLs of the gateways to use now


async def post_record(
    session: aiohttp.ClientSession,
    base: str,
    append: Append,
    timing: Timing,
    clock: Clock,
    stats: Stats,
    headers: dict[str, str] | None = None,
    via: str = "",
) -> Attempt:
    at = clock()
    try:
        async with session.post(
            f"{base}{PREFIX}{append.stream}", data=append.record, headers={**TEXT, **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=timing.request_timeout),
        ) as r:  # fmt: skip
            await r.read()
            attempt = Attempt(r.status, via=via or base, at=at, took=clock() - at)
    except NO_ANSWER as exc:
        attempt = Attempt(None, error=type(exc).__name__, via=via or base, at=at, took=clock() - at)
    append.attempts.append(attempt)
    stats.note("append", attempt.status if attempt.status is not None else attempt.error)
    return attempt


async def writer(
    session: aiohttp.ClientSession,
    gateways: Gateways,
    stream: str,
    name: str,
    history: list[Append],
    *,
    producer: bool,
    rng: random.Random,
    stop: asyncio.Event,
    timing: Timing,
    clock: Clock,
    stats: Stats,
    max_ops: int,
    pad: int = 0,
    pace: float | None = None,
) -> None:
    """Append ``name:0;``, ``name:1;``, ... until ``stop`` (or ``max_ops``).

    A producer retries each record (same bytes, same Producer-Seq) until it is
    acknowledged; it stops for good if one is refused (4xx) or after
    ``producer_give_up`` seconds without an answer, since its next Producer-Seq
    would then be a gap.
    """
    for seq in range(max_ops):
        if stop.is_set():
            return
        append = Append(stream, name, seq, producer=producer, pad=pad)
        history.append(append)
        headers = {"Producer-Id": name, "Producer-Epoch": "0", "Producer-Seq": str(seq)} if producer else None
        began = clock()
        while True:
            base = rng.choice(gateways())
            attempt = await post_record(session, base, append, timing, clock, stats, headers)
            if not producer or attempt.kind == ACKED:
                break
            if attempt.kind == FAILED or clock() - began > timing.producer_give_up:
                return
            await asyncio.sleep(rng.uniform(*timing.retry_pause))
        if attempt.kind == ACKED:
            await asyncio.sleep(rng.uniform(0, timing.pace if pace is None else pace))
        else:
            await asyncio.sleep(rng.uniform(*timing.retry_pause))


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's lines (CR LF, LF or CR stripped), however long: a catch-up over SSE
    may carry megabytes in one ``data:`` line, past aiohttp's line length limit."""
    buffer = bytearray()
    async for chunk in response.content.iter_any():
        start = len(buffer)
        buffer += chunk
        scan = max(0, start - 1)
        while True:
            end = buffer.find(b"\n", scan)
            if end < 0:
                break
            yield bytes(buffer[:end]).rstrip(b"\r")
            del buffer[: end + 1]
            scan = 0
    if buffer:
        yield bytes(buffer).rstrip(b"\r")


def _note_data(log: ReaderLog, data: bytes) -> None:
    if data:
        log.received += data
        log.arrivals.append((time.monotonic(), len(log.received)))


async def sse_reader(
    session: aiohttp.ClientSession,
    gateways: Gateways,
    log: ReaderLog,
    *,
    offset: str = "-1",
    rng: random.Random,
    deadline: float,
    timing: Timing,
    stats: Stats,
) -> None:
    """Tail with SSE until the stream closes or ``deadline`` (time.monotonic()).

    A data event counts once the control event after it arrives: a connection
    that breaks between the two resumes from the previous control event's
    offset and gets that data again, once.
    """
    while not log.finished and time.monotonic() < deadline:
        base = rng.choice(gateways())
        log.connections += 1
        log.connects.append((time.monotonic(), base))
        try:
            async with session.get(
                f"{base}{PREFIX}{log.stream}", params={"offset": offset, "live": "sse"},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=timing.sse_read_timeout),
            ) as r:  # fmt: skip
                log.statuses[r.status] += 1
                stats.note("sse", r.status)
                if r.status != 200:
                    await r.read()
                    await asyncio.sleep(rng.uniform(*timing.retry_pause))
                    continue
                event, lines, pending = "", [], bytearray()
                async for line in _lines(r):
                    if time.monotonic() >= deadline:
                        return
                    if line:
                        if line.startswith(b"event:"):
                            event = line[6:].strip().decode()
                        elif line.startswith(b"data:"):
                            lines.append(line[5:].removeprefix(b" "))
                        continue
                    # A blank line dispatches the event.
                    if event == "data":
                        pending += b"\n".join(lines)
                    elif event == "control":
                        try:
                            control = json.loads(b"\n".join(lines))
                            next_offset = control["streamNextOffset"]
                        except (ValueError, KeyError, TypeError) as exc:
                            log.protocol_errors.append(f"bad control event {b'|'.join(lines)[:200]!r}: {exc}")
                            break
                        _note_data(log, bytes(pending))
                        pending.clear()
                        offset = next_offset
                        if control.get("upToDate") and log.caught_up is None:
                            log.caught_up = time.monotonic()
                        if control.get("streamClosed"):
                            log.finished = True
                            return
                    event, lines = "", []
        except NO_ANSWER as exc:
            log.errors[type(exc).__name__] += 1
            stats.note("sse", type(exc).__name__)
        await asyncio.sleep(rng.uniform(0.0, 0.05))


async def long_poll_reader(
    session: aiohttp.ClientSession,
    gateways: Gateways,
    log: ReaderLog,
    *,
    offset: str = "-1",
    rng: random.Random,
    deadline: float,
    timing: Timing,
    stats: Stats,
) -> None:
    """Tail with long-polls until the stream closes or ``deadline``."""
    cursor: str | None = None
    while not log.finished and time.monotonic() < deadline:
        base = rng.choice(gateways())
        params = {"offset": offset, "live": "long-poll"}
        if cursor:
            params["cursor"] = cursor
        log.connections += 1
        log.connects.append((time.monotonic(), base))
        try:
            async with session.get(
                f"{base}{PREFIX}{log.stream}", params=params,
                timeout=aiohttp.ClientTimeout(total=timing.long_poll_timeout + timing.request_timeout),
            ) as r:  # fmt: skip
                body = await r.read()
                log.statuses[r.status] += 1
                stats.note("long-poll", r.status)
                if r.status in (200, 204):
                    if "Stream-Next-Offset" not in r.headers:
                        log.protocol_errors.append(
                            f"{r.status} without Stream-Next-Offset at offset {offset}"
                        )
                        await asyncio.sleep(rng.uniform(*timing.retry_pause))
                        continue
                    _note_data(log, body if r.status == 200 else b"")
                    offset = r.headers["Stream-Next-Offset"]
                    cursor = r.headers.get("Stream-Cursor", cursor)
                    if r.headers.get("Stream-Up-To-Date") == "true" and log.caught_up is None:
                        log.caught_up = time.monotonic()
                    if r.headers.get("Stream-Closed", "").lower() == "true":
                        log.finished = True
                    continue
        except NO_ANSWER as exc:
            log.errors[type(exc).__name__] += 1
            stats.note("long-poll", type(exc).__name__)
        await asyncio.sleep(rng.uniform(*timing.retry_pause))


READERS = {"sse": sse_reader, "long-poll": long_poll_reader}


@dataclass
class Answer:
    status: int
    headers: CIMultiDict[str]
    body: bytes


class Refused(AssertionError):
    """A request the workload needs got a definitive answer other than 2xx."""


async def until_2xx(
    make: Callable[[], object], what: str, timeout: float = 30.0, pause: float = 0.2
) -> Answer:
    """Retry a request (``make`` returns the request context) until a 2xx: through 5xx and
    no answer, until ``timeout``. A 4xx is definitive: raised at once (``Refused``)."""
    deadline = time.monotonic() + timeout
    last = "nothing yet"
    while time.monotonic() < deadline:
        try:
            async with make() as r:  # type: ignore[attr-defined]
                body = await r.read()
                if 200 <= r.status < 300:
                    return Answer(r.status, CIMultiDict(r.headers), body)
                last = f"{r.status} {body[:200]!r}"
                if 400 <= r.status < 500:
                    raise Refused(f"{what}: answered {last}")
        except NO_ANSWER as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(pause)
    raise AssertionError(f"{what}: no 2xx within {timeout}s; last answer: {last}")


async def read_all(session: aiohttp.ClientSession, base: str, stream: str, timeout: float = 60.0) -> bytes:
    """The whole stream by catch-up reads from the start (archive included), following
    Stream-Next-Offset until Stream-Up-To-Date."""
    deadline = time.monotonic() + timeout
    offset, out = "-1", bytearray()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"catch-up read of {stream!r} via {base} did not finish in {timeout}s")
        r = await until_2xx(
            lambda offset=offset: session.get(
                f"{base}{PREFIX}{stream}",
                params={"offset": offset},
                timeout=aiohttp.ClientTimeout(total=10),
            ),  # fmt: skip
            f"catch-up read of {stream!r} at {offset} via {base}",
            timeout=remaining,
        )
        body = r.body
        out += body
        next_offset = r.headers["Stream-Next-Offset"]
        if r.headers.get("Stream-Up-To-Date") == "true":
            return bytes(out)
        if next_offset == offset and not body:
            raise AssertionError(f"catch-up read of {stream!r} via {base} stuck at {offset}")
        offset = next_offset
