"""State compaction's runs (docs/compaction.md), for the archive worker (``archiver.py``).

A compacted stream (created with ``Stream-Compaction: state``) stores one message an
entry (lua/_prelude.lua add_entries). A *run*, under the stream's archive lease:

1. reads the stream's Redis log from where folding starts (the log's start, past any fork
   point: ``Compacted.barrier``) up to ``to``: where the compaction lag begins (messages
   younger than ``lag_ms`` or among the last ``lag_bytes`` are never folded);
2. folds those messages with the rules (``gateway/protocol/compaction.py``, ``Retained``):
   what a run keeps is folded again by the next, so nothing but the kept deletes' fold
   times (``keys.fold``) is remembered between runs, and a worker that dies mid-run leaves
   nothing another cannot redo;
3. applies the drops with lua/compact.lua in bounded steps, in the order the fold gave
   them (any prefix of them leaves a stream every reader materializes alike: a dropped
   message's dropper comes later in the stream and is dropped, if ever, later in the order),
   then the tombstones past their retention; the last step moves the stream's ``cto``.

Fencing: every step checks the lease's token, the stream's incarnation, where the run
started (``cto``) and the newest fork point (``fkmax``) inside Redis: a worker that lost
its lease, or whose stream was forked, deleted or compacted by another meanwhile, changes
nothing. Archived data is never dropped (archived segments are not rewritten yet), and the
archiver archives a compacted stream only below ``cto``: what goes to Parquet was folded.
"""

from __future__ import annotations

import bisect
import logging
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

from redis.asyncio import Redis

from gateway.config import Settings
from gateway.protocol import offsets
from gateway.protocol.compaction import Message, Retained
from gateway.protocol.entries import messages
from gateway.protocol.models import text
from gateway.redis_io import keys, layout
from gateway.redis_io.connections import Client
from gateway.redis_io.contracts import COMPACT, CompactDone, status_of
from gateway.telemetry import metrics

from .archive_files import PAGE, LogPage
from .archive_lease import Lease, Leases
from .clock import now_ms

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

    @classmethod
    def of(cls, settings: Settings) -> CompactionPolicy:
        return cls(
            lag_ms=int(settings.compaction_lag_seconds * 1000),
            lag_bytes=settings.compaction_lag_bytes,
            tombstone_ms=int(settings.compaction_tombstone_seconds * 1000),
            min_interval_ms=int(settings.compaction_interval_seconds * 1000),
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


class Compactor:
    def __init__(self, redis: Client, leases: Leases, policy: CompactionPolicy) -> None:
        self.redis = redis
        self.leases = leases
        self.policy = policy
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
        now, policy = await self._now(lease.sid), self.policy
        upto, running_to = int(meta.get("cto") or 0), int(meta.get("cnext") or 0)
        barrier, base = int(meta.get("fkmax") or 0), int(meta["base"])
        start = max(int(meta.get("arch") or base), base, barrier)
        # A delete may go only where nothing readable comes before the fold: a write of its key
        # there (archived, inherited, or below a fork point) would come back to life.
        whole = start == 0
        closed = meta.get("closed") == "1"  # nobody appends: the byte lag protects no tail
        young, edge = now - policy.lag_ms, int(meta["tail"]) - (0 if closed else policy.lag_bytes)
        folded_at = await self._fold_times(lease.sid, meta["created"])
        eligible, when = await self._waiting(lease.sid, max(upto, start), young, edge)
        expiring = whole and any(ms < now - policy.tombstone_ms for ms in folded_at.values())
        if not eligible and not expiring:  # nothing new past the lag, no delete due: no fold
            return Outcome(again_ms=max(when, now + 1000) if when else 0)
        if int(meta.get("cat") or 0) > now - policy.min_interval_ms and not closed:
            return Outcome(again_ms=int(meta["cat"]) + policy.min_interval_ms)
        retained = Retained()
        order: list[int] = []
        entries = _Entries()
        to, again, last, folded, oldest = start, 0, -1, 0, 0
        async for page in self._pages(lease, start):
            taken: list[Message] = []  # folded a page at a time (one call: ~1 µs a message less)
            for entry_id, data, appended_at in page:
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
            folded += len(taken)
            if again or to != end:
                break
        metrics.COMPACTION_FOLDED_MESSAGES.inc(folded)
        metrics.COMPACTION_BEHIND.set(max(0, young - oldest) / 1000 if oldest else 0)
        doomed, partial = entries.doomed(order)
        if whole and not partial:  # (a message kept for its entry's sake may be a write of a deleted key)
            expired = retained.expired_tombstones(now - policy.tombstone_ms, keep_from=last)
            doomed += entries.doomed(expired)[0]
            expirable = [ms for position, ms in retained.tombstones() if position < last]
            if expirable:  # look again when the first kept delete's retention ends (unless sooner)
                due = min(expirable) + policy.tombstone_ms + 1
                again = min(again, due) if again else due
        if again:
            again = max(again, now + 1000)
        to = max(to, upto, running_to)  # (a longer lag since, a run that died: never moves back)
        tombstones = [
            f"{position}:{ms}"
            for position, ms in retained.tombstones()
            if position >= upto or position not in folded_at
        ]
        if not doomed and to <= upto and not tombstones:
            return Outcome(again_ms=again)
        size = sum(entries.size(position) for position in doomed)
        dropped = await self._apply(lease, meta, upto, barrier, to, doomed, entries, tombstones)
        if dropped is None:
            return Outcome(again_ms=now + 1000)
        metrics.COMPACTION_RUNS.inc()
        metrics.COMPACTION_DROPPED_BYTES.inc(size)
        return Outcome(to > upto, dropped, size, again)

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
        upto: int,
        barrier: int,
        to: int,
        doomed: list[int],
        entries: _Entries,
        tombstones: list[str],
    ) -> int | None:
        """The run's drops in steps (with the new deletes' fold times); the entries
        deleted, or None if the stream moved under the run (plan again)."""
        step = self.policy.step_positions
        count = max(1, -(-len(doomed) // step), -(-len(tombstones) // step))
        deleted = 0
        keep_ms = self.policy.tombstone_ms + 86_400_000  # the fold record outlives its deletes
        for i in range(count):
            part, told = doomed[i * step : (i + 1) * step], tombstones[i * step : (i + 1) * step]
            size = sum(entries.size(p) for p in part)
            reply = await self.leases.fenced(
                COMPACT.name, lease, meta["created"], upto, barrier, to,
                "1" if i == count - 1 else "0", size, " ".join(told), keep_ms, *part,
            )  # fmt: skip
            if status_of(reply) != "ok":
                log.info("compaction of %s stopped: %s", keys.path_of(lease.sid), status_of(reply))
                return None
            deleted += int(CompactDone(*reply).deleted)
        return deleted

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
