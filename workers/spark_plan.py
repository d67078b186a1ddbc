"""Planning, pure (a warning logged aside): what a batch reads per stream (``spans``), the spans packed into
partitions (``pack``) and each stream's end for the next micro-batch (``plan_ends``).

A batch's offsets map each stream's path to ``<offset>@<created>``: the protocol offset and
the incarnation it belongs to (the stream's creation time, ms; ``split``), so that a stream
deleted and created again at its path is told apart from the one read before, whatever
its tail. Offsets without ``@`` (checkpoints from before, ``startingOffsets``) name no
incarnation: only a tail below them then says "created again"."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .streams_client import BEGINNING, StreamInfo, position, start_position, token

log = logging.getLogger("durable_streams.spark")  # one logger for the whole data source
MAX_SPANS_PER_PARTITION = 256  # streams a partition reads at most (see pack)


def split(value: str) -> tuple[str, str | None]:
    """One stream's value in a batch's offsets: its offset and incarnation (None: not named)."""
    offset, _, created = value.partition("@")
    return offset, created or None


def joined(offset: str, created: str | None) -> str:
    """One stream's value in a batch's offsets (``split``'s inverse)."""
    return f"{offset}@{created}" if created else offset


@dataclass(frozen=True)
class Span:
    """One stream's part of a batch: [start, end), ``size`` bytes (positions), in the
    incarnation ``created`` (None: not known)."""

    path: str
    start: str  # an offset, or -1
    end: str
    size: int
    created: str | None = None


def spans(start: Mapping[str, str], end: Mapping[str, str], streaming: bool = True) -> list[Span]:
    """What a batch from ``start`` to ``end`` reads, per stream. A function of the two
    offsets alone, so a re-run batch reads the same: a stream missing from ``start``
    reads from -1, and so, when ``streaming``, does one created again (``plan_ends``):
    whose end names another incarnation than its start, or lies below it."""
    out = []
    for path in sorted(end):
        stop, created = split(end[path])
        begin, before = split(start.get(path, BEGINNING))
        first, last = start_position(begin), position(stop)
        if streaming and (last < first or (before and created and before != created)):
            begin, first = BEGINNING, 0
        if last > first:
            out.append(Span(path, begin, stop, last - first, created))
    return out


def pack(items: Sequence[Span], partition_bytes: int, overhead: int | None = None) -> list[list[Span]]:
    """Spans packed into partitions of about ``partition_bytes`` (first fit, largest
    first; each span also counts ``overhead``, by default 1/256 of a partition, for its
    requests: thousands of small streams spread over several tasks, at most 256 a task).
    Deterministic: same spans, same partitions."""
    if overhead is None:
        overhead = max(partition_bytes // MAX_SPANS_PER_PARTITION, 1)
    bins: list[tuple[int, list[Span]]] = []
    for span in sorted(items, key=lambda s: (-s.size, s.path)):
        cost = span.size + overhead
        for i, (used, members) in enumerate(bins):
            if used + cost <= partition_bytes:
                members.append(span)
                bins[i] = (used + cost, members)
                break
        else:
            bins.append((cost, [span]))
    return [sorted(members, key=lambda s: s.path) for _, members in bins]


def plan_ends(
    start: Mapping[str, str],
    streams: Mapping[str, StreamInfo],
    budget: int | None,
    favored: Iterable[str] = (),
) -> tuple[dict[str, str], set[str]]:
    """Each stream's end for the next micro-batch, and the JSON streams left waiting.

    Without a budget, every stream's tail. With one (``maxBytesPerTrigger``), the
    budget is shared out like water: streams with the smallest backlogs first, each
    taking at most an equal share of what is left. A byte stream can end anywhere, so
    it takes its share exactly; a JSON stream can only end on a message boundary, and
    only tails are known to be one, so it goes whole when its backlog fits its share,
    and otherwise waits, ahead of the others next time (``favored``), when it goes
    whole even past the budget. A batch that would admit nothing admits the smallest
    waiting JSON stream: the budget is soft, never a stall.

    Streams in ``start`` but not in ``streams`` are gone and left out; new streams join
    (from -1) once they hold data. A stream created again (another incarnation than its
    start names, or a tail below its start) is read from its beginning; while it is
    empty its end is its start of the new incarnation, so that it is said once.
    """
    favored = set(favored)
    end: dict[str, str] = {}
    todo: list[tuple[str, int, int, StreamInfo]] = []  # path, start position, backlog, info
    for path, info in sorted(streams.items()):
        tail = position(info.tail)
        begin = start.get(path)
        if begin is None and tail == 0:
            continue  # empty: joins with its first byte
        offset, before = split(begin) if begin is not None else (BEGINNING, None)
        first = start_position(offset)
        again = bool(before and info.created and before != info.created)
        if again:
            log.warning("%s: created again (at %s; read up to %s of the one created at %s): read from its "
                        "start", path, info.created, offset, before)  # fmt: skip
        elif tail < first:
            log.warning("%s: tail %s is below its offset %s: created again? read from its start", path,
                        info.tail, offset)  # fmt: skip
            again = True
        if again:
            first = 0
            if tail == 0:  # nothing to read yet: the offsets move to it (said once, not every poll)
                end[path] = joined(info.tail, info.created)
                continue
        if tail == first:
            if begin is not None:
                end[path] = begin
            continue
        todo.append((path, first, tail - first, info))
    if budget is None:
        end.update({path: joined(info.tail, info.created) for path, _, _, info in todo})
        return dict(sorted(end.items())), set()

    order = sorted(todo, key=lambda item: (item[0] not in favored, item[2], item[0]))
    remaining, waiting = budget, []
    for i, (path, first, backlog, info) in enumerate(order):
        share = max(remaining, 0) // (len(order) - i)
        if info.json:
            take = backlog if backlog <= share or path in favored else 0
        else:
            take = min(backlog, share)
        if take:
            end[path] = joined(info.tail if take == backlog else token(first + take), info.created)
            remaining -= take
        else:
            waiting.append((path, first, backlog, info))
            if path in start:
                end[path] = start[path]
    if remaining == budget and waiting:  # nothing admitted: the first in line goes anyway
        path, first, backlog, info = waiting.pop(0)
        take = backlog if info.json else min(backlog, budget)
        end[path] = joined(info.tail if take == backlog else token(first + take), info.created)
    return dict(sorted(end.items())), {path for path, _, _, info in waiting if info.json}
