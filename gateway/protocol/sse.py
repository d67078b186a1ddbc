"""Server-Sent Events framing for live reads (protocol section 5.8)."""

from __future__ import annotations

import base64
import re

import orjson

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


_LEADS = ((2, (0xE0, 0xC0)), (3, (0xF0, 0xE0)), (4, (0xF8, 0xF0)))  # (length, (mask, lead bits))


def cut_character(data: bytes) -> int:
    """How many bytes at the end of ``data`` begin a UTF-8 character that is cut
    off (0-3): a read cut by its size limit holds them back for the next event,
    so no character is split into two replacement characters."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead (or ASCII) byte: how long is its character?
            length = next((n for n, (mask, lead) in _LEADS if byte & mask == lead), 1)
            return back if length > back else 0
    return 0


def data_event(payload: bytes, *, text: bool) -> bytes:
    """An ``event: data`` frame; binary payloads are base64 text.

    Every line of the payload gets its own ``data:`` line, so a CR or LF in
    stream data can never end the event early or inject a fake one.
    """
    body = payload.decode("utf-8", "replace") if text else base64.b64encode(payload).decode()
    return f"event: data\n{_data_lines(body)}\n".encode()


def _data_lines(body: str) -> str:
    """``data:`` lines as the reference server writes them (no space after
    the colon), except that a line starting with a space gets one extra: SSE
    parsers strip exactly one, so the line's own space survives."""
    return "".join(
        f"data: {line}\n" if line.startswith(" ") else f"data:{line}\n" for line in _LINE_BREAK.split(body)
    )


def control_event(
    next_offset: str,
    *,
    cursor: str | None,
    up_to_date: bool,
    closed: bool,
) -> bytes:
    """An ``event: control`` frame telling the client where it is."""
    fields: dict[str, object] = {"streamNextOffset": next_offset}
    if cursor is not None and not closed:
        fields["streamCursor"] = cursor
    if up_to_date or closed:
        fields["upToDate"] = True
    if closed:
        fields["streamClosed"] = True
    return b"event: control\ndata:" + orjson.dumps(fields) + b"\n\n"


def events(
    data: bytes | None, next_offset: str, *, text: bool, cursor: str | None, up_to_date: bool, closed: bool
) -> bytes:
    """A data event (when there is data) and the control event that follows it."""
    frame = data_event(data, text=text) if data is not None else b""
    return frame + control_event(next_offset, cursor=cursor, up_to_date=up_to_date, closed=closed)


def comment(text: str = "") -> bytes:
    """A comment line: keeps idle connections open through proxies."""
    return f": {text}\n\n".encode()
