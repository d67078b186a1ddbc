"""http/aiohttp_seam.py: the door between aiohttp's parser and its queue, tested with a mock
transport on the test's loop (as uvicorn tests its protocols), no socket, no Redis; and the
aiohttp internals it names, checked against the installed aiohttp (``tools/aiohttp-next``
runs this file against aiohttp's newest release)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader

from gateway.http import aiohttp_seam


class Transport(asyncio.Transport):
    """What a connection writes, and whether it closed or paused reading."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def answers(self) -> list[bytes]:
        """The status lines written, in order."""
        return re.findall(rb"HTTP/1\.[01] \d{3}[^\r]*", bytes(self.out))


class Door(aiohttp_seam.Protocol):
    """Takes ``POST /door``, answered when the test says (``answer``)."""

    __slots__ = ("taken",)

    def take(self, message: RawRequestMessage, payload: StreamReader) -> bool:
        if message.method != "POST" or message.path != "/door":
            return False
        self.taken.append(payload.read_nowait(-1))
        self.begin()
        return True

    def answer(self) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 204 Door\r\n\r\n")
        self.done()


async def aiohttp_handler(request: web.Request) -> web.Response:
    if request.path.endswith("-unread"):  # as a 404, 401, 403: its body never read
        return web.Response(text="unread")
    return web.Response(text=f"aiohttp {request.method} {request.path} {await request.text()}")


_OPEN: list[Door] = []


@pytest.fixture(autouse=True)
async def _lose_connections() -> AsyncIterator[None]:
    """Each test's connections lost at its end, so their start() tasks end (a task left
    pending is garbage a later test's collection reports)."""
    yield
    while _OPEN:
        _OPEN.pop().connection_lost(None)
    await settle()


def connection(keepalive_timeout: float = 75.0) -> tuple[Door, Transport]:
    app = aiohttp_seam.application(Door)
    app.router.add_route("*", "/{tail:.*}", aiohttp_handler)
    server = app._make_handler(loop=asyncio.get_running_loop(), keepalive_timeout=keepalive_timeout)
    door = server()
    assert isinstance(door, Door)
    door.taken = []
    transport = Transport()
    door.connection_made(transport)
    _OPEN.append(door)
    return door, transport


def post(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)


UPGRADE = b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"


async def settle() -> None:
    for _ in range(20):  # aiohttp's start() task, its handler's task, their writes
        await asyncio.sleep(0)


def test_the_aiohttp_internals_it_names_exist() -> None:
    """aiohttp is pinned below 3.15; a newer one must still have these (aiohttp_seam.PRIVATE)."""
    for cls, names in aiohttp_seam.PRIVATE.items():
        slots = {s for c in cls.__mro__ for s in getattr(c, "__slots__", ())}
        instance_attrs = (
            web.Server(aiohttp_handler, loop=asyncio.new_event_loop()).__dict__ if cls is web.Server else {}
        )
        missing = [n for n in names if n not in slots and not hasattr(cls, n) and n not in instance_attrs]
        assert not missing, f"aiohttp {cls.__name__} lacks {missing}: fix gateway/http/aiohttp_seam.py"


async def test_a_message_taken_holds_those_behind_it_until_answered() -> None:
    door, transport = connection()
    door.data_received(post("/door", b"1") + post("/other", b"2") + post("/door", b"3"))
    await settle()
    assert door.taken == [b"1"] and transport.answers() == []  # /other waits for the door's answer
    door.answer()
    await settle()
    # /other went to aiohttp, and /door behind it too (aiohttp had one in hand): in order
    assert transport.answers() == [b"HTTP/1.1 204 Door", b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]
    assert door.taken == [b"1"] and b"aiohttp POST /door 3" in transport.out
    door.data_received(post("/door", b"4"))  # aiohttp idle again: the door's
    await settle()
    assert door.taken == [b"1", b"4"]
    door.answer()


async def test_a_parse_error_behind_a_taken_message_is_answered_after_it() -> None:
    door, transport = connection()
    door.data_received(post("/door", b"1"))
    door.data_received(b"NOT HTTP\r\n\r\n")
    await settle()
    assert transport.answers() == []
    door.answer()
    await settle()
    assert transport.answers() == [b"HTTP/1.1 204 Door", b"HTTP/1.0 400 Bad Request"]


async def test_reading_pauses_while_too_many_wait() -> None:
    door, transport = connection()
    door.data_received(post("/door", b"0"))
    door.data_received(b"".join(post("/other", b"%d" % n) for n in range(aiohttp_seam.MAX_HELD)))
    assert not transport.reading
    door.answer()
    for _ in range(100):  # aiohttp holds reading paused until its own queue drained
        await settle()
        if transport.reading:
            break
    assert transport.reading
    for _ in range(100):
        await settle()
    assert len(transport.answers()) == 1 + aiohttp_seam.MAX_HELD


async def test_a_half_close_after_a_whole_request_is_answered_then_closed() -> None:
    door, transport = connection()
    door.data_received(post("/door", b"1"))
    assert door.eof_received() is True  # kept open for the answer
    assert not transport.closed
    door.answer()
    assert transport.closed and transport.answers() == [b"HTTP/1.1 204 Door"]


async def test_a_half_close_behind_aiohttps_requests_closes_after_the_last() -> None:
    door, transport = connection()
    door.data_received(post("/other", b"1") + post("/other", b"2"))
    assert door.eof_received() is True
    await settle()
    assert transport.answers() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]
    assert transport.closed


async def test_a_half_close_when_all_is_answered_or_cut_short_closes_at_once() -> None:
    door, transport = connection()
    assert not door.eof_received()  # nothing asked: closed (asyncio closes on a falsy answer)
    door, transport = connection()
    door.data_received(post("/other", b"12345")[:-2])  # a body cut short: nothing to answer
    assert not door.eof_received()


async def test_an_upgrade_behind_a_taken_message_keeps_its_tail() -> None:
    """aiohttp answers an Upgrade it does not serve as a plain request, then parses what
    followed it: the door keeps that order and those bytes."""
    door, transport = connection()
    door.data_received(post("/door", b"1") + UPGRADE + post("/other", b"2"))
    await settle()
    door.answer()
    await settle()
    statuses = transport.answers()
    assert statuses[0] == b"HTTP/1.1 204 Door" and len(statuses) >= 2


# -- what a review of the seam found (each failed before its fix) --------------------------


async def test_a_half_close_while_aiohttp_holds_its_last_message_closes_after_it() -> None:
    """The FIN comes after start() took the message, before its handler ran (on a socket:
    the usual timing), or after the handler answered, before start() looped."""
    door, transport = connection()
    door.data_received(post("/other", b"1"))
    await asyncio.sleep(0)  # start() popped it; the handler's task has not run
    assert door.eof_received() is True
    await settle()
    assert transport.answers() == [b"HTTP/1.1 200 OK"] and transport.closed
    door, transport = connection()
    door.data_received(post("/other", b"1"))
    for _ in range(20):
        await asyncio.sleep(0)
        if transport.answers():
            break
    closing = door.eof_received()
    await settle()
    assert not closing or transport.closed


async def test_an_upgrade_held_behind_the_door_pauses_reading() -> None:
    """Nothing after an upgrade can be parsed: what follows is held, so reading pauses
    (before: 64 MiB held, copied quadratically)."""
    door, transport = connection()
    door.data_received(post("/door", b"1") + UPGRADE)
    door.data_received(b"x" * 65536)
    assert not transport.reading
    door.answer()
    await settle()
    assert transport.answers()[0] == b"HTTP/1.1 204 Door"


async def test_a_body_aiohttp_never_read_is_let_go_once_answered() -> None:
    door, transport = connection()
    door.data_received(post("/other-unread", b"x" * 200_000))
    await settle()
    assert transport.answers() == [b"HTTP/1.1 200 OK"]
    assert door._framer._last is None  # (the body itself: aiohttp's, freed with its request)


async def test_a_half_close_cutting_short_a_request_behind_the_doors_closes_after_its_answer() -> None:
    door, transport = connection()
    door.data_received(post("/door", b"1") + post("/other", b"12345")[:-2])
    assert door.eof_received() is True  # the door's append is under way: answered first
    door.answer()
    assert transport.closed and transport.answers() == [b"HTTP/1.1 204 Door"]


async def test_a_half_closed_connection_is_closed_once_answered_whatever_happens() -> None:
    """The backstop: even when no answer's end closes it (here: aiohttp's waiter is pending
    again while the FIN was taken as for a request in hand), it is closed within a second or
    so once all is answered, never left half open."""
    door, transport = connection()
    door.data_received(post("/other", b"1"))
    await asyncio.sleep(0)  # start() popped it
    assert door.eof_received() is True
    door._close = False  # as if the close were missed: only the backstop is left
    for _ in range(30):
        await asyncio.sleep(0.1)
        if transport.closed:
            break
    assert transport.closed
