"""State compaction's runs (docs/compaction.md), for the archive worker (``archiver.py``).

A compacted stream (created with ``Stream-Compaction: state``) stores one message an
entry (lua/_prelude.lua add_entries). A *run*, under the stream's archive lease:

1. reads the stream's Redis log from where folding starts (the log's start, past any fork
   point: ``Compacted.barrier``) up to ``to``: where the compaction lag begins (messages
   younger than ``lag_ms`` or among the last ``lag_bytes`` are never folded); a *deep* run
   (``_deep``: paced by ``dirty_ratio``) reads the archived segments before it
   (``compacted_segments.py``);
2. folds those messages with the rules (``gateway/protocol/compaction.py``, ``Retained``):
   what a run keeps is folded again by the next, so nothing but the kept deletes' fold
   times (``keys.fold``) is remembered between runs, and a worker that dies mid-run leaves
   nothing another cannot redo;
3. applies the drops with lua/compact.lua in bounded steps, in the order the fold gave
   them (any prefix of them leaves a stream every reader materializes alike: a dropped
   message's dropper comes later in the stream and is dropped, if ever, later in the order),
   then the tombstones past their retention; the last step moves the stream's ``cto``. A
   deep run first replaces the archived segments with drops, in order (each at once: what
   a message's drop depends on is later in the stream, but for a snapshot's start, which
   waits for its end: ``_Markers``).

Fencing: every step checks the lease's token, the stream's incarnation, where the run
started (``cto``) and the newest fork point (``fkmax``) inside Redis: a worker that lost
its lease, or whose stream was forked, deleted or compacted by another meanwhile, changes
nothing; lua/archive_replace.lua checks the same for a segment. The archiver archives a
compacted stream only below ``cto``: what goes to Parquet was folded.
"""

from __future__ import annotations

import bisect
import logging
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio import Redis

from gateway.archive.segments import Segment
from gateway.config import Settings
from gateway.protocol import offsets
from gateway.protocol.compaction import Control, Message, Retained, classify
from gateway.protocol.entries import messages
from gateway.protocol.models import text
from gateway.redis_io import keys, layout
from gateway.redis_io.connections import Client
from gateway.redis_io.contracts import COMPACT, CompactDone, status_of
from gateway.telemetry import metrics

from .archive_files import PAGE, LogPage, SegmentFiles
from .archive_lease import Lease, Leases
from .clock import now_ms
from .compacted_segments import ArchivedPart, Group, groups, rewritten

log = logging.getLogger("durable_streams.compaction")
RawPage = list[tuple[bytes, list[bytes]]]  # XRANGE as Redis sends it: [id, [field, value, ...]]
STEP_POSITIONS = 1000  # dropped messages per compact.lua step (a few ms of XDELs)


@dataclass(frozen=True)
class CompactionPolicy:
    """The defaults are the command line's (gateway/config.py)."""

    lag_ms: int = int(Settings.compaction_lag_seconds * 1000)
    lag_bytes: int = Settings.compaction_lag_bytes
    tombstone_ms: int = int(Settings.compaction_tombstone_seconds * 1000)
    step_positions: int = STEP_POSITIONS
    min_interval_ms: int = int(Settings.compaction_interval_seconds * 1000)  # between runs of a stream
    # folded since the last deep run / kept by it, for a deep run (compacted_segments.py)
    dirty_ratio: float = Settings.compaction_archive_ratio

    @classmethod
    def of(cls, settings: Settings) -> CompactionPolicy:
        return cls(
            lag_ms=int(settings.compaction_lag_seconds * 1000),
            lag_bytes=settings.compaction_lag_bytes,
            tombstone_ms=int(settings.compaction_tombstone_seconds * 1000),
            min_interval_ms=int(settings.compaction_interval_seconds * 1000),
            dirty_ratio=settings.compaction_archive_ratio,
        )


@dataclass(frozen=True)
class Outcome:
    """What a run did: ``moved`` (its fold point moved), the messages and bytes it dropped,
    and when to look again (ms; 0: nothing waits in the lag)."""

    moved: bool = False
    dropped: int = 0
    dropped_bytes: int = 0
    again_ms: int = 0


class _Entries:
    """The log entries a run read, in order: where each starts and the bytes it holds, in
    arrays (a run may read millions). An entry holds one message, but for those an older
    build wrote grouped: deleted only once all their messages are (``_grouped``)."""

    def __init__(self) -> None:
        self.positions = array("q")
        self.sizes = array("q")
        self._grouped: dict[int, list[int]] = {}  # message position -> [entry position, left]

    def add(self, held: list[tuple[int, bytes]]) -> None:
        self.positions.append(held[0][0])
        self.sizes.append(sum(len(m) for _, m in held))
        if len(held) > 1:
            counter = [held[0][0], len(held)]
            for position, _ in held:
                self._grouped[position] = counter

    def doomed(self, order: list[int]) -> tuple[list[int], bool]:
        """The entries to delete for dropped messages ``order``, in that order (an entry goes
        with its last message), and whether some dropped message stays, its entry's others
        kept (then a dropped write may outlive its key's delete)."""
        out, touched = [], []
        for position in order:
            counter = self._grouped.get(position)
            if counter is None:
                out.append(position)
            else:
                counter[1] -= 1
                touched.append(counter)
                if counter[1] == 0:
                    out.append(counter[0])
        return out, any(counter[1] for counter in touched)

    def size(self, position: int) -> int:
        return self.sizes[bisect.bisect_left(self.positions, position)]


@dataclass
class Replaced:
    """What a deep run's segment replacements dropped."""

    dropped: int = 0
    dropped_bytes: int = 0
    segments: dict[int, Segment] = field(default_factory=dict)  # by start: the replacing one


class _Markers:
    """The snapshot markers a run folded (their positions): a reset drops a snapshot's end
    before its start, so a start archived before the segment (or log) its end is dropped
    from waits for that one (``deferred``): no reader sees an end without its start."""

    def __init__(self) -> None:
        self.starts: set[int] = set()
        self.ends: set[int] = set()

    def add(self, page: list[Message]) -> None:
        for position, message in page:
            if b"snapshot-" in message:  # (cheap: most messages are no marker)
                event = classify(message)
                if isinstance(event, Control) and event.control == "snapshot-start":
                    self.starts.add(position)
                elif isinstance(event, Control) and event.control == "snapshot-end":
                    self.ends.add(position)

    def deferred(self, parts: list[Group], cold: list[int], hot: list[int]) -> set[int]:
        """The dropped archived starts to drop after the Redis steps, their end dropped from
        a later file (of ``parts``, the archive as the run leaves it) or the Redis log."""
        starts = [group[0].start for group, _ in parts]

        def part(position: int) -> int:
            return bisect.bisect_right(starts, position) - 1

        ends = [part(p) for p in cold if p in self.ends] + [len(parts) for p in hot if p in self.ends]
        latest = max(ends, default=-1)
        return {p for p in cold if p in self.starts and part(p) < latest}


def _plan(
    segments: list[Segment], sizes: list[int], folded: _Entries, cold: list[int], target: int,
    markers: _Markers, hot: list[int],
) -> tuple[list[Group], list[Group]]:  # fmt: skip
    """A deep run's files to write, in order (a prefix of them applied leaves a stream readers
    materialize alike: each message's dropper is later): before the Redis steps, then after
    them (snapshot starts whose end goes later: ``_Markers``). ``sizes``: the bytes folded of
    each segment; ``folded``: the archived messages folded."""
    starts = [s.start for s in segments]
    drops: dict[int, set[int]] = {}
    for position in cold:
        drops.setdefault(bisect.bisect_right(starts, position) - 1, set()).add(position)
    kept = [size - sum(folded.size(p) for p in drops.get(i, ())) for i, size in enumerate(sizes)]
    parts = groups(segments, kept, drops, target)
    deferred = markers.deferred(parts, cold, hot)
    first = [(group, dropped - deferred) for group, dropped in parts]
    later = [(group, dropped & deferred) for group, dropped in parts if dropped & deferred]
    return [g for g in first if rewritten(g)], later


class Compactor:
    def __init__(
        self, redis: Client, leases: Leases, policy: CompactionPolicy, files: SegmentFiles, file_bytes: int
    ) -> None:
        self.redis = redis
        self.leases = leases
        self.policy = policy
        self.archived = ArchivedPart(files)
        self.file_bytes = file_bytes  # a deep run joins small neighbours up to this (the archive's min_bytes)
        # The key layout this process writes (``Membership.writing``; None: not known now).
        # Compaction drops messages only from layout.COMPACTING on: builds before it misread gaps.
        self.writing: Callable[[], int | None] = lambda: layout.CURRENT
        self._raw: Redis | None = None  # XRANGE replies as sent, on one Redis (``_pages``)
        if isinstance(redis, Redis):
            self._raw = Redis(connection_pool=redis.connection_pool)
            self._raw.set_response_callback("XRANGE", lambda response, **options: response)

    async def run(self, lease: Lease, meta: dict[str, str]) -> Outcome:
        """One run on the lease's stream (``meta``: its meta hash as just read), if one is due."""
        if not meta.get("cmp") or meta.get("deleted"):
            return Outcome()
        writing = self.writing()
        if writing is None or writing < layout.COMPACTING:  # (the rolling change not finished)
            return Outcome(again_ms=now_ms() + 60_000)
        now = await self._now(lease.sid)
        folded_at = await self._fold_times(lease.sid, meta["created"])
        segments = await self._deep(lease, meta, folded_at, now)
        try:
            return await self._run(lease, meta, now, folded_at, segments)
        except FileNotFoundError as exc:  # (deleted by hand, a backup restored without it...)
            if not segments:
                raise
            path = keys.path_of(lease.sid)
            log.warning("compaction of %s: an archived file is missing (%s): no deep run", path, exc)
            return await self._run(lease, meta, now, folded_at, [], missing=True)

    async def _run(
        self,
        lease: Lease,
        meta: dict[str, str],
        now: int,
        folded_at: dict[int, int],
        segments: list[Segment],
        missing: bool = False,
    ) -> Outcome:
        """``run``, deep if ``segments`` (the archived ones to fold first). ``missing``: a deep
        run that met a missing file, run again without: paced as if it had been (no deep run
        again before the next is due by the ratio)."""
        policy = self.policy
        upto, running_to = int(meta.get("cto") or 0), int(meta.get("cnext") or 0)
        barrier, base = int(meta.get("fkmax") or 0), int(meta["base"])
        arch = int(meta.get("arch") or base)
        start = segments[0].start if segments else max(arch, base, barrier)
        start = max(start, base, barrier)
        # A delete may go only where nothing readable comes before the fold: a write of its key
        # there (archived and not folded, inherited, or below a fork point) would come back.
        whole = start == 0
        closed = meta.get("closed") == "1"  # nobody appends: the byte lag protects no tail
        young, edge = now - policy.lag_ms, int(meta["tail"]) - (0 if closed else policy.lag_bytes)
        eligible, when = await self._waiting(lease.sid, max(upto, start, arch), young, edge)
        expiring = whole and any(ms < now - policy.tombstone_ms for ms in folded_at.values())
        if not eligible and not expiring and not segments:  # nothing new past the lag, no delete due
            return Outcome(again_ms=max(when, now + 1000) if when else 0)
        if int(meta.get("cat") or 0) > now - policy.min_interval_ms and not closed:
            return Outcome(again_ms=int(meta["cat"]) + policy.min_interval_ms)
        retained = Retained()
        order: list[int] = []
        markers = _Markers()
        last, folded, sizes, archived = -1, 0, [], _Entries()
        async for page in self.archived.messages(lease, segments, start):  # (a segment a page)
            order += retained.fold(page, now, folded_at)
            markers.add(page)
            folded += len(page)
            for message in page:
                archived.add([message])
            sizes.append(sum(len(m) for _, m in page))
            if page:
                last = page[-1][0]
        entries = _Entries()
        to, again, oldest = max(start, arch), 0, 0
        async for raw in self._pages(lease, to):
            taken: list[Message] = []  # folded a page at a time (one call: ~1 µs a message less)
            for entry_id, data, appended_at in raw:
                position, appended = int(entry_id.split(b"-", 1)[0]), int(appended_at)
                if position >= upto and not oldest:
                    oldest = appended
                held = messages(position, data)
                end = held[-1][0] + len(held[-1][1])
                if appended > young or end > edge:
                    again = appended + policy.lag_ms + 1 if appended > young else 0
                    break
                entries.add(held)
                taken += held
                to, last = end, held[-1][0]
            order += retained.fold(taken, now, folded_at)
            markers.add(taken)
            folded += len(taken)
            if again or to != end:
                break
        metrics.COMPACTION_FOLDED_MESSAGES.inc(folded)
        metrics.COMPACTION_BEHIND.set(max(0, young - oldest) / 1000 if oldest else 0)
        cold, hot = [p for p in order if p < arch], [p for p in order if p >= arch]
        doomed, partial = entries.doomed(hot)
        retention = policy.tombstone_ms
        if whole and not partial:  # (a message kept for its entry's sake may be a write of a deleted key)
            expired = retained.expired_tombstones(now - retention, keep_from=last)
            cold += [p for p in expired if p < arch]
            hot += [p for p in expired if p >= arch]
            doomed += entries.doomed([p for p in expired if p >= arch])[0]
        # look again when the first kept delete's retention ends (unless sooner); one this run
        # could not drop (the newest folded, or kept for a grouped entry's sake) waits for more
        ends = [ms + retention + 1 for p, ms in retained.tombstones() if p < last] if whole else []
        if not whole and max(base, barrier) == 0 and arch > 0:  # only a deep run drops them (_deep)
            since = int(meta.get("cdt") or -1)
            ends += [ms + retention + 1 for ms in folded_at.values() if ms + retention >= since]
            ends += [ms + retention + 1 for _, ms in retained.tombstones()]
        if future := [end for end in ends if end > now]:
            again = min(again, min(future)) if again else min(future)
        if meta.get("ckw") == "1" and to > upto and not segments:  # the deep run it waited for: soon
            again = now
        if again:
            again = max(again, now + 1000)
        to = max(to, upto, running_to)  # (a longer lag since, a run that died: never moves back)
        tombstones = [  # the fold record's new or moved times (Retained.fold), written first
            f"{position}:{ms}" for position, ms in retained.tombstones() if folded_at.get(position) != ms
        ]
        if not doomed and not cold and to <= upto and not tombstones and not segments and not missing:
            return Outcome(again_ms=again)
        first, later = _plan(segments, sizes, archived, cold, self.file_bytes, markers, hot)
        inc, fence, replaced = meta.get("inc", ""), (upto, barrier), Replaced()
        if (first or tombstones) and not await self._claim(lease, meta, fence, to, tombstones):
            return Outcome(again_ms=now + 1000)
        if first and not await self._replace(lease, inc, first, fence, replaced):
            return Outcome(again_ms=now + 1000)
        restamped: list[str] = []
        if first and tombstones:  # a delete restarted by a file's drop: from when that drop is done
            stamp = await self._now(lease.sid)
            restamped = [f"{p}:{stamp}" for p, ms in retained.tombstones() if ms == now]
        size = sum(entries.size(position) for position in doomed)
        kept = sum(sizes) + sum(entries.sizes) - replaced.dropped_bytes - size
        waiting = any(ms < now - retention for _, ms in retained.tombstones())  # due, not droppable
        deep = f"{to} {max(0, kept)} {now} {int(waiting)}" if segments else ""
        if missing:
            deep = f"{to} {int(meta.get('cak') or 0)} {now} 0"
        records = (restamped, [p for p in cold if p in folded_at])
        dropped = await self._apply(lease, meta, fence, to, doomed, entries, records, deep)
        if dropped is None or not await self._replace(lease, inc, later, (to, barrier), replaced):
            return Outcome(again_ms=now + 1000)
        size += replaced.dropped_bytes
        metrics.COMPACTION_RUNS.inc()
        metrics.COMPACTION_DROPPED_BYTES.inc(size)
        return Outcome(to > upto or bool(segments), dropped + replaced.dropped, size, again)

    async def _now(self, sid: str) -> int:
        """Redis' clock (ms), the one the append times are on (a worker's may be off)."""
        stream = keys.stream_keys(sid)[0]
        seconds, micros = await self.leases.scripts.command(stream, "TIME")
        return int(seconds) * 1000 + int(micros) // 1000

    async def _waiting(self, sid: str, since: int, young: int, edge: int) -> tuple[bool, int]:
        """Whether a message from ``since`` on is past the lag (a run has something to fold);
        if not, when one will be by time (ms; 0: none there, or held by the byte lag: the
        appends that move it hint the stream again)."""
        stream = keys.stream_keys(sid)[1]
        page = cast(LogPage, await self.redis.xrange(stream, min=offsets.entry_id(since), max="+", count=1))
        if not page:
            return False, 0
        entry_id, fields = page[0]
        appended, position = int(fields[b"t"]), int(entry_id.split(b"-", 1)[0])
        held = messages(position, fields[b"d"])
        if appended <= young and held[-1][0] + len(held[-1][1]) <= edge:
            return True, 0
        return False, appended + self.policy.lag_ms + 1 if appended > young else 0

    async def _apply(
        self,
        lease: Lease,
        meta: dict[str, str],
        fence: tuple[int, int],
        to: int,
        doomed: list[int],
        entries: _Entries,
        records: tuple[list[str], list[int]],
        deep: str,
        final: bool = True,
    ) -> int | None:
        """The run's drops from the Redis log in steps (with the fold record's changes:
        ``records``, the new deletes' fold times and the archived deletes dropped); the
        entries deleted, or None if the stream moved under the run (plan again). The last
        step moves the fold point, unless not ``final`` (then ``cnext`` only)."""
        step, (tombstones, forget) = self.policy.step_positions, records
        count = max(1, *(-(-len(items) // step) for items in (doomed, tombstones, forget)))
        deleted = 0
        keep_ms = self.policy.tombstone_ms + 86_400_000  # the fold record outlives its deletes
        for i in range(count):
            part, told = doomed[i * step : (i + 1) * step], tombstones[i * step : (i + 1) * step]
            gone = " ".join(str(p) for p in forget[i * step : (i + 1) * step])
            last = final and i == count - 1
            reply = await self.leases.fenced(
                COMPACT.name, lease, meta["created"], *fence, to, "1" if last else "0",
                sum(entries.size(p) for p in part), " ".join(told), keep_ms, gone,
                deep if last else "", *part,
            )  # fmt: skip
            if status_of(reply) != "ok":
                log.info("compaction of %s stopped: %s", keys.path_of(lease.sid), status_of(reply))
                return None
            deleted += int(CompactDone(*reply).deleted)
        return deleted

    async def _claim(
        self, lease: Lease, meta: dict[str, str], fence: tuple[int, int], to: int, tombstones: list[str]
    ) -> bool:
        """Before a deep run's first file changes: [cto, to) is marked as being compacted
        (``cnext``: a fork asked for there from then on is 409), and the deletes' new fold
        times are kept (before the older writes that moved them go: Retained.fold)."""
        claimed = await self._apply(lease, meta, fence, to, [], _Entries(), (tombstones, []), "", final=False)
        return claimed is not None

    async def _replace(
        self, lease: Lease, inc: str, parts: list[Group], fence: tuple[int, int], done: Replaced
    ) -> bool:
        """A deep run's files, written and put in place in order (counted in ``done``); False
        if the stream moved under the run (plan again)."""
        for group, dropped in parts:
            now = done.segments.get(group[0].start)  # (written before the Redis steps)
            got = await self.archived.replace(lease, inc, group if now is None else [now], dropped, fence)
            if got is None:
                log.info("compaction of %s stopped: its archive moved", keys.path_of(lease.sid))
                return False
            done.segments[group[0].start], count, size = got
            done.dropped += count
            done.dropped_bytes += size
        return True

    async def _deep(
        self, lease: Lease, meta: dict[str, str], folded_at: dict[int, int], now: int
    ) -> list[Segment]:
        """The archived segments a run folds (from its start: the stream's, or the newest fork
        point), when a deep run is due: what was folded since the last (``cac``: where it
        folded to) reached ``dirty_ratio`` of what that one kept (``cak`` bytes), or a delete's
        retention ended since the last (``cdt``: when it ran) in a stream folded from its
        beginning (only a deep run drops deletes once part of a stream is archived); else
        none (the run folds the Redis log only: what it drops there made older archived
        messages redundant, which wait)."""
        floor = max(int(meta["base"]), int(meta.get("fkmax") or 0))
        arch = int(meta.get("arch") or meta["base"])
        if arch <= floor or not meta.get("inc"):
            return []
        dirty = int(meta.get("cto") or 0) - max(int(meta.get("cac") or 0), floor)
        due = dirty > 0 and dirty >= self.policy.dirty_ratio * int(meta.get("cak") or 0)
        # deletes whose retention ended since the last deep run (which expired those before it)
        since, retention = int(meta.get("cdt") or -1), self.policy.tombstone_ms
        ended = any(since <= ms + retention < now for ms in folded_at.values())
        # ... or one the last could not drop (the newest folded then), once more was folded
        ended = ended or (meta.get("ckw") == "1" and int(meta.get("cto") or 0) > int(meta.get("cac") or 0))
        if not due and not (floor == 0 and ended):
            return []
        segments = await self.archived.segments(lease, meta["inc"], floor, arch)
        if not due and segments and segments[0].start > 0:  # (retention dropped the beginning: no expiry)
            return []
        return segments

    async def _pages(self, lease: Lease, start: int) -> AsyncIterator[list[tuple[bytes, bytes, bytes]]]:
        """The stream's log entries from ``start`` as (id, data, append ms), a page at a time.
        On one Redis the replies are taken as Redis sends them (redis-py would build a dict
        per entry: a third of a run's time): an entry's fields are ``d <data> t <ms> ...``,
        in that order (add_entries, parts.commands)."""
        stream, cursor = keys.stream_keys(lease.sid)[1], offsets.entry_id(start)
        while True:
            if self._raw is not None:
                raw = cast(RawPage, await self._raw.xrange(stream, min=cursor, max="+", count=PAGE))
                page = [(entry_id, fields[1], fields[3]) for entry_id, fields in raw]
            else:
                parsed = cast(LogPage, await self.redis.xrange(stream, min=cursor, max="+", count=PAGE))
                page = [(entry_id, fields[b"d"], fields[b"t"]) for entry_id, fields in parsed]
            if not page:
                return
            lease.check()  # a long read: stop early once the lease is gone
            yield page
            cursor = "(" + text(page[-1][0])

    async def _fold_times(self, sid: str, created: str) -> dict[int, int]:
        """When each kept delete was folded (ms), from the stream's fold record."""
        raw = cast(dict[bytes, bytes], await self.redis.hgetall(keys.fold(sid)))
        if text(raw.get(b"created", b"")) != created:
            return {}
        return {int(k): int(v) for k, v in raw.items() if k != b"created"}
