"""Log entries: how a request body is stored, and how stored entries become messages.

A body is stored as a few *bounded* log entries, whatever its size or message count, so
one script stores it in bounded time and a read that starts inside an entry has bounded
work to skip:

- a byte body is cut into entries of at most ``BYTE_ENTRY_BYTES``; offsets may fall
  anywhere inside one (reads cut entries), so the cut is invisible to clients;
- a JSON body's messages (compactly encoded, so never holding a raw newline) are joined
  by ``\\n`` into entries of at most ``JSON_ENTRY_MESSAGES`` messages and about
  ``JSON_ENTRY_BYTES`` (one larger message goes alone). A message's position is the
  entry's plus the lengths of the messages before it: separators take no positions, so
  offsets are exactly those of one entry per message (how streams were stored before).

Each entry is sent to the scripts as a pair: how many positions it takes, then its
bytes (``lua/_prelude.lua`` add_entries). Everything that reads raw log entries of a JSON
stream splits them with ``messages`` (the scripts' reads do it in Lua, ``collect``).
"""

from __future__ import annotations

from collections.abc import Iterable

BYTE_ENTRY_BYTES = 1024 * 1024
JSON_ENTRY_BYTES = 64 * 1024
JSON_ENTRY_MESSAGES = 1024
SEPARATOR = b"\n"

LogEntry = tuple[int, bytes | memoryview]  # (positions it takes, stored bytes)


def pack_bytes(body: bytes, limit: int = BYTE_ENTRY_BYTES) -> list[LogEntry]:
    """A byte body's entries: consecutive slices of at most ``limit`` bytes, views of the
    body (no copy: a request's body is held once in memory)."""
    if len(body) <= limit:
        return [(len(body), body)] if body else []
    view = memoryview(body)
    return [(len(part), part) for part in (view[i : i + limit] for i in range(0, len(body), limit))]


def pack_messages(
    messages: Iterable[bytes], max_bytes: int = JSON_ENTRY_BYTES, max_messages: int = JSON_ENTRY_MESSAGES
) -> list[LogEntry]:
    """Encoded JSON messages joined into bounded entries.

    One pass into a bytearray: a list of millions of small ``bytes`` first costs ~25x
    more (each encoder result kept alive fragments the heap)."""
    out: list[LogEntry] = []
    buf, count = bytearray(), 0
    for message in messages:
        if count and (count >= max_messages or len(buf) + len(message) >= max_bytes):
            out.append((len(buf) - count + 1, bytes(buf)))
            buf.clear()
            count = 0
        if count:
            buf += SEPARATOR
        buf += message
        count += 1
    if count:
        out.append((len(buf) - count + 1, bytes(buf)))
    return out


def one_each(entries: list[LogEntry]) -> list[LogEntry]:
    """JSON entries as one entry a message (how a compacted stream stores them:
    docs/compaction.md; lua/_prelude.lua add_entries does the same for a script's entries)."""
    out: list[LogEntry] = []
    for _, data in entries:
        for message in bytes(data).split(SEPARATOR):
            out.append((len(message), message))
    return out


def messages(position: int, data: bytes) -> list[tuple[int, bytes]]:
    """A JSON stream's stored entry at ``position`` as its messages with their positions."""
    if SEPARATOR not in data:
        return [(position, data)]
    out = []
    for message in data.split(SEPARATOR):
        out.append((position, message))
        position += len(message)
    return out


def end_of(position: int, data: bytes, whole: bool) -> int:
    """The position after a piece a read returns at ``position``: a byte run takes its
    length; a JSON piece (one message, or several of one stored entry, joined by
    SEPARATOR: a page read in bulk) the lengths of its messages."""
    return position + len(data) - (data.count(SEPARATOR) if whole else 0)


def messages_between(position: int, data: bytes, lo: int, hi: int) -> tuple[int, bytes] | None:
    """The messages of a JSON entry at ``position`` that start in [lo, hi), as one
    piece (where the first starts, the messages joined by SEPARATOR); None if none."""
    kept: list[bytes] = []
    first = None
    for pos, message in messages(position, data):
        if pos >= hi:
            break
        if pos >= lo:
            first = pos if first is None else first
            kept.append(message)
    return None if first is None else (first, SEPARATOR.join(kept))


def flatten(entries: Iterable[LogEntry]) -> list[int | bytes | memoryview]:
    """Entries as script arguments: each one's positions, then its bytes."""
    return [part for entry in entries for part in entry]


def message_count(entries: Iterable[LogEntry]) -> int:
    """How many JSON messages a JSON body's entries hold."""
    return sum(bytes(data).count(SEPARATOR) + 1 for _, data in entries)  # bytes(bytes): no copy


def positions(entries: Iterable[LogEntry]) -> int:
    """The positions a body's entries take (its size as offsets count it)."""
    return sum(size for size, _ in entries)


def stored_bytes(entries: Iterable[LogEntry]) -> int:
    """The bytes a body's entries hold (JSON: with the separators)."""
    return sum(len(data) for _, data in entries)
