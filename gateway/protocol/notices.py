"""The "tail moved" notices append.lua publishes, and stitching them together.

A notice is ``<old tail> <new tail> <closed 0|1> t<ms>``, ``<ms>`` being Redis' clock
when the script ran (the write's acknowledgement follows at once: what the fan-out delay
is measured from); for appends no larger than the configured threshold it goes on with
`` <size>,<size>,...\\n`` and the entries' bytes, so readers woken by it need no Redis read
at all. A size is an entry's length, or ``<length>:<positions>`` for a JSON entry of several messages
(entries.py), split into its messages here. ``deleted`` (from delete.lua), ``created``
(create.lua: an earlier stream of the name may have expired unannounced) and
anything unparsable carry no data: readers re-read. Notices of builds before the time
field have none (``sent_ms`` None); such a build reads a timed notice as unparsable, so
during a rolling update its readers re-read Redis rather than miss anything.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .entries import messages


@dataclass(frozen=True)
class Notice:
    old_tail: int
    tail: int
    closed: bool
    entries: tuple[tuple[int, bytes], ...] | None  # None: too large to ride along
    sent_ms: int | None = None  # Redis' clock when the script published it (ms since the epoch)


@dataclass(frozen=True)
class Delivery:
    """What a reader at some position learns from consecutive notices."""

    start: int
    tail: int
    closed: bool
    entries: tuple[tuple[int, bytes], ...]
    # Encoded responses, shared by every reader this delivery reaches.
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)


def parse(message: bytes) -> Notice | None:
    head, newline, data = message.partition(b"\n")
    parts = head.split(b" ")
    try:
        old_tail, tail, closed = int(parts[0]), int(parts[1]), parts[2] == b"1"
        sent_ms = None
        if len(parts) > 3 and parts[3][:1] == b"t":
            sent_ms = int(parts[3][1:])
            del parts[3]
        if len(parts) < 4:
            return Notice(old_tail, tail, closed, None if tail > old_tail else (), sent_ms)
        entries: list[tuple[int, bytes]] = []
        pos, offset = old_tail, 0
        for size in parts[3].split(b","):
            length, group, took = size.partition(b":")
            piece = data[offset : offset + int(length)]
            if group:  # a JSON entry of several messages (protocol/entries.py)
                split = messages(pos, piece)
                entries += split
                pos, end = split[-1][0] + len(split[-1][1]), pos + int(took)
                if pos != end:
                    return None
            else:
                entries.append((pos, piece))
                pos += len(piece)
            offset += int(length)
    except (IndexError, ValueError):
        return None
    if not newline or pos != tail or offset != len(data):
        return None
    return Notice(old_tail, tail, closed, tuple(entries), sent_ms)


def stitch(notices: Iterable[Notice | None], start: int) -> Delivery | None:
    """Everything from ``start`` to the newest notice's tail, if the notices
    cover that range without a gap and all carry their data; else None (also
    when one of them is None: ``deleted``, or unparsable)."""
    entries: list[tuple[int, bytes]] = []
    position, closed, newest = start, False, None
    for notice in notices:
        if notice is None:
            return None
        newest = notice
        if notice.tail <= position and not (notice.closed and notice.tail == position):
            continue  # already behind the reader
        if notice.old_tail != position or notice.entries is None:
            return None
        entries.extend(notice.entries)
        position, closed = notice.tail, notice.closed
    if newest is None or position != newest.tail:
        return None
    return Delivery(start, position, closed, tuple(entries))


# What one entry of a notice holds beyond its bytes: the (position, data) tuple, the
# position's int and the bytes object's header. A JSON append of many small messages is
# mostly this (a 9 KB notice of 400 messages holds ~57 KB).
_ENTRY_OVERHEAD = 128
_NOTICE_OVERHEAD = 256


def held_bytes(notice: Notice) -> int:
    """About how much memory a parsed notice holds (its data and the objects around it)."""
    if not notice.entries:
        return _NOTICE_OVERHEAD
    return _NOTICE_OVERHEAD + sum(len(data) + _ENTRY_OVERHEAD for _, data in notice.entries)


_ROOMY = 16  # Recent's bounds while roomy: 512 notices, 1 MiB


class Recent:
    """The last few notices of one stream, oldest first: at most ``size``, and no more
    than ``budget`` bytes of them (``held_bytes``).

    Only a shortcut: a reader the kept notices do not cover reads Redis, so the bound
    costs at most a (shared) read. Without it every subscribed stream held its last
    ``size`` notices, each up to --notice-payload-bytes of data (~57 KB once a JSON
    batch of small messages is split): up to ~1.8 MB per stream a reader had touched.
    """

    def __init__(self, size: int = 32, budget: int = 64 * 1024) -> None:
        self._size, self._budget = size, budget
        self._notices: deque[Notice] = deque()
        self._held: deque[int] = deque()  # held_bytes of each notice, in the same order
        self._total = 0
        self._deliveries: dict[int, Delivery | None] = {}  # readers at one offset share one
        # While a channel has notices to take round its readers (channels.py), those since
        # the round began must stay, or the readers it has yet to visit all read Redis instead.
        self._roomy = False

    @property
    def roomy(self) -> bool:
        """Whether the bounds are ``_ROOMY`` times wider; set back, they apply at once."""
        return self._roomy

    @roomy.setter
    def roomy(self, roomy: bool) -> None:
        self._roomy = roomy
        self._trim()

    def add(self, notice: Notice | None) -> None:
        self._deliveries.clear()
        if notice is None:
            self.clear()  # deleted, or unknown: nobody may trust older notices
            return
        held = held_bytes(notice)
        self._notices.append(notice)
        self._held.append(held)
        self._total += held
        self._trim()

    def _trim(self) -> None:
        size, budget = self._size, self._budget
        if self._roomy:
            size, budget = size * _ROOMY, budget * _ROOMY
        if len(self._notices) > size or self._total > budget:
            self._deliveries.clear()
        while self._notices and (len(self._notices) > size or self._total > budget):
            self._notices.popleft()
            self._total -= self._held.popleft()

    def clear(self) -> None:
        self._deliveries.clear()
        self._notices.clear()
        self._held.clear()
        self._total = 0

    @property
    def held(self) -> int:
        """``held_bytes`` of the notices kept."""
        return self._total

    def __len__(self) -> int:
        return len(self._notices)

    def delivery(self, start: int) -> Delivery | None:
        if start not in self._deliveries:
            self._deliveries[start] = stitch(self._notices, start)
        return self._deliveries[start]
