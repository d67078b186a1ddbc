"""The one place that reaches into aiohttp's server internals (aiohttp 3.14).

What it gives the gateway, in aiohttp's own terms:

* ``application(protocol, **kwargs)``: a ``web.Application`` whose connections are
  ``protocol`` (a ``Protocol`` subclass) rather than aiohttp's ``RequestHandler``, whoever
  hosts it (run_app, gunicorn's worker, a test server).
* ``Protocol``: aiohttp's connection, with a *door* between its request parser (llhttp, the
  one parser every byte of the connection goes through) and its request queue. Each
  message llhttp frames is offered to ``take`` when aiohttp has nothing in hand; one taken
  is the subclass's to answer, and the messages behind it wait until it called ``done``,
  so answers leave in request order. Anything not taken is aiohttp's, exactly as without
  the door. It also answers a client that half-closes after its last request (FIN after
  a complete request) before closing, on every route.

Everything private it touches is listed in ``PRIVATE`` and checked against the installed
aiohttp by tests/test_aiohttp_seam.py (and by ``tools/aiohttp-next``, against aiohttp's
newest release, so a change there is found before users find it).
"""

from __future__ import annotations

import asyncio
import warnings
from collections import deque
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

# The private names of aiohttp this module uses: on RequestHandler instances, and on
# web.Application / web.Server.
PRIVATE: Final = {
    RequestHandler: (
        "_parser", "_messages", "_request_in_progress", "_waiter", "_request_count",
        "_handler_waiter", "_keepalive_handle", "_keepalive_timeout", "_next_keepalive_close_time",
        "_process_keepalive", "_manager", "_loop", "_close", "_force_close", "_buffer_paused",
        "_reading_paused", "_current_request",
    ),
    StreamReader: ("_buffer",),
    web.Application: ("_make_handler",),
    web.Server: ("_kwargs", "_loop"),
}  # fmt: skip
# Messages held behind one being answered by the door before reading pauses (aiohttp's own
# bound on its queue, web_protocol.MAX_MSG_QUEUE_SIZE).
MAX_HELD: Final = 32
_NOTHING: Final = ((), False, b"")
# How often a half-closed connection is looked at until all it asked is answered.
HALF_CLOSED_CHECK_SECONDS: Final = 1.0


def application(protocol: type[Protocol], **kwargs: Any) -> web.Application:
    """A web.Application (``kwargs``: its own) whose connections are ``protocol``s."""
    app = _Application(**kwargs)
    app.protocol = protocol
    return app


with warnings.catch_warnings():  # aiohttp discourages subclassing Application (a DeprecationWarning)
    warnings.simplefilter("ignore", DeprecationWarning)

    class _Application(web.Application):
        protocol: type[Protocol]

        def _make_handler(
            self, *, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any
        ) -> web.Server:
            # aiohttp's own server with everything it set (handler, request factory, handler
            # arguments), only its protocol class ours.
            server = super()._make_handler(loop=loop, **kwargs)
            return _Server(
                self,
                server.request_handler,
                request_factory=server.request_factory,
                handler_cancellation=server.handler_cancellation,
                loop=loop,
                **server._kwargs,
            )


class _Server(web.Server):
    def __init__(self, app: _Application, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = app

    def __call__(self) -> RequestHandler:
        return self.app.protocol(self, loop=self._loop, **self._kwargs)


Message = tuple[RawRequestMessage, StreamReader]


def whole_body(payload: StreamReader) -> bytes:
    """The body of a message llhttp delivered whole (``payload.is_eof()``), as it came.
    Not ``read_nowait``: it resumes reading, which re-enters data_received and the parser
    once more for every append (measured: a tenth of the door's CPU)."""
    if not payload.total_bytes:
        return b""
    chunks = payload._buffer
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Protocol(RequestHandler):
    """aiohttp's connection with a door before its queue (see the module's docstring).
    Subclasses override ``take``; nothing else here is theirs to call but ``done``,
    ``aiohttp_idle``, ``app`` and ``half_closed``."""

    __slots__ = ("_framer", "_own", "_door_paused", "half_closed")

    def __init__(self, manager: _Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._framer = _Framer(self._parser, self)
        self._parser = self._framer  # type: ignore[assignment]  # every feed goes through the door
        self._own = False  # a message the door took is being answered
        self._door_paused = False  # reading paused by _hold_reading
        self.half_closed = False  # the client sent its FIN

    @property
    def app(self) -> web.Application:
        manager = self._manager
        assert isinstance(manager, _Server)
        return manager.app

    # -- for subclasses -------------------------------------------------------------

    def take(self, message: RawRequestMessage, payload: StreamReader) -> bool:
        """Whether the door answers this message itself (called only while ``aiohttp_idle``
        and no message of the door's is being answered). Taking it, it must call ``done``
        once its answer is written."""
        return False

    def begin(self) -> None:
        """A message was taken: aiohttp's shutdown waits for it, its keep-alive timer does not
        close the connection meanwhile."""
        self._own = self._request_in_progress = True

    def done(self) -> None:
        """The taken message is answered: the messages behind it go on."""
        self._own = self._request_in_progress = False
        if self._handler_waiter is not None and not self._handler_waiter.done():
            self._handler_waiter.set_result(None)  # aiohttp's shutdown() waited for this answer
        transport = self.transport
        if self._close or self._force_close:  # closed meanwhile (shutdown): after this answer
            if transport is not None:
                transport.close()
            return
        if self._keepalive_timeout > 0:
            self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout
            if self._keepalive_handle is None:
                self._keepalive_handle = self._loop.call_at(
                    self._next_keepalive_close_time, self._process_keepalive
                )
        if self.half_closed and not self._framer.complete():  # a FIN cut the next request short
            if transport is not None:
                transport.close()
            return
        framer = self._framer
        if framer.held or framer._error is not None or framer._upgrade_tail is not None:
            self.data_received(b"")  # aiohttp's own way to go on parsing (as it resumes reading)
        if self.half_closed and self._all_answered() and transport is not None:
            transport.close()

    def aiohttp_idle(self) -> bool:
        """aiohttp has no message in hand: it waits for its next, or never had one (its
        start() task may not have run yet on a new connection). With no waiter and requests
        before, start() is between its queue and a handler (popped, the handler's task not
        run yet; or answered, not yet back at the queue): busy."""
        if self._messages or self._request_in_progress:
            return False
        waiter = self._waiter
        return not waiter.done() if waiter is not None else not self._request_count

    @property
    def busy(self) -> bool:
        return self._own

    # -- aiohttp's hooks ------------------------------------------------------------

    def _process_keepalive(self) -> None:
        # aiohttp closes a connection whose start() waits for a message: not while the door
        # answers one (re-armed in done).
        if self._own:  # (messages are held only behind one being answered)
            self._keepalive_handle = None
            return
        super()._process_keepalive()

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client half-closed (asyncio: returning True keeps the transport open for
        writing; uvloop may call this again). What it sent whole is still answered, then the
        connection closes. Closed at once: a connection with nothing to answer; a live read
        (SSE, long-poll: a reader that closed is gone, whatever it left half open); and a
        request cut short (a body not all in), after the door's answer if one is under way."""
        self.half_closed = True
        if self._all_answered() or self._live():
            return None
        if not self._framer.complete():
            return True if self._own else None  # (done() closes after the door's answer)
        if not self._own and not self._messages and not self._framer.held:
            # aiohttp holds the last message (its handler perhaps not started yet, or done and
            # start() not back at its queue): it closes the connection after answering it.
            self.close()
        self._loop.call_later(HALF_CLOSED_CHECK_SECONDS, self._close_once_answered)
        return True

    def _close_once_answered(self) -> None:
        """A backstop: a half-closed connection is read no more, so nothing would notice one
        left open once all is answered (its socket and task kept until garbage collection)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._all_answered():
            transport.close()
        else:
            self._loop.call_later(HALF_CLOSED_CHECK_SECONDS, self._close_once_answered)

    def _live(self) -> bool:
        request = self._current_request
        return request is not None and request.query.get("live") in ("sse", "long-poll")

    def _all_answered(self) -> bool:
        return not self._own and not self._framer.held and self.aiohttp_idle()

    def _last_queued_taken(self) -> None:
        """aiohttp took the next message off its queue: after a FIN, the last one closes."""
        if self.half_closed and not self._messages and not self._framer.held and not self._own:
            self.close()

    def _hold_reading(self, held: int) -> None:
        """Reading pauses while too many messages wait behind the door's, or an upgrade does
        (nothing after it can be parsed), and resumes (unless aiohttp holds it paused itself)
        once they went on. The transport is paused directly, not through aiohttp's flags:
        aiohttp may resume it (a body read), so every _go_on with messages held, or after
        this paused, ends here, deciding again."""
        transport = self.transport
        if transport is None:
            return
        if held >= MAX_HELD or (held and self._framer.upgrading()):
            self._door_paused = True
            if transport.is_reading():
                transport.pause_reading()
        elif self._door_paused:
            self._door_paused = False
            if not self._buffer_paused and not self._reading_paused and not transport.is_reading():
                transport.resume_reading()


class _Framer:
    """aiohttp's request parser as aiohttp sees it, with the door between it and the queue.

    llhttp frames every byte; what it returns is offered to the door (the first message,
    when nothing is ahead of it) or handed on; while the door answers, later messages wait
    here (``held``), a parse error with them, in order."""

    __slots__ = ("_parser", "_door", "held", "_error", "_upgrade_tail", "_last", "_going")

    def __init__(self, parser: Any, door: Protocol) -> None:
        self._parser = parser
        self._door = door
        self.held: deque[Message] = deque()
        self._error: HttpProcessingError | None = None  # raised once what came before it went on
        self._upgrade_tail: bytes | None = None  # the last held message is an upgrade: what follows it
        self._last: StreamReader | None = None  # the newest message's body
        self._going = False  # _go_on is under way

    def feed_data(self, data: bytes) -> tuple[Any, bool, bytes]:
        if self._upgrade_tail is not None:  # llhttp stopped at an upgrade still held: not HTTP after it
            self._upgrade_tail += data
            return _NOTHING if self._going else self._go_on()
        try:
            messages, upgraded, tail = self._parser.feed_data(data)
        except HttpProcessingError as exc:
            if not self.held and not self._door.busy and not self._going:
                raise  # aiohttp answers it (400), as always
            self._error, messages, upgraded, tail = exc, (), False, b""
        if messages:
            self.held.extend(messages)
            last = self._last = messages[-1][1]  # (let go once whole: a body aiohttp never read)
            last.on_eof(lambda: setattr(self, "_last", None) if self._last is last else None)
        if upgraded:
            self._upgrade_tail = tail
        # Called again from within take (reading a body can resume reading): the loop under
        # way goes on with what came.
        return _NOTHING if self._going else self._go_on()

    def _go_on(self) -> tuple[Any, bool, bytes]:
        door, held = self._door, self.held
        out: list[Message] = []
        self._going = True
        try:
            while held and not door.busy:
                message, payload = held.popleft()
                # (an upgrade is aiohttp's: what follows it is not HTTP, and only it decides)
                if not message.upgrade and door.aiohttp_idle() and door.take(message, payload):
                    self._parser.message_consumed()  # (aiohttp's queue slot, which it never took)
                else:  # aiohttp's, and so is everything behind it: it answers them in order
                    out.append((message, payload))
                    out += held
                    held.clear()
        finally:
            self._going = False
        if held or door._door_paused:
            door._hold_reading(len(held))
        if not held and not door.busy and self._error is not None:
            if not out:
                error, self._error = self._error, None
                raise error
            door._loop.call_soon(door.data_received, b"")  # raised next, after these
        if not out:
            return _NOTHING
        if self._upgrade_tail is not None and not held:
            tail, self._upgrade_tail = self._upgrade_tail, None
            return out, True, tail
        return out, False, b""

    def upgrading(self) -> bool:
        return self._upgrade_tail is not None

    def complete(self) -> bool:
        """Every message framed so far has its whole body (nothing cut short by a FIN)."""
        return self._last is None or self._last.is_eof()

    def message_consumed(self) -> None:
        self._parser.message_consumed()
        self._door._last_queued_taken()

    def set_upgraded(self, val: bool) -> None:
        self._parser.set_upgraded(val)

    def feed_eof(self) -> Any:
        return self._parser.feed_eof()

    def pause_reading(self) -> None:
        self._parser.pause_reading()
