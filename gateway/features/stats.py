"""The live statistics the web console's overview shows (gateway/http/stats.py), kept in
Redis so that every gateway answers the same: not one process' view.

Every gateway process records, every ``TICK_SECONDS`` (a task of its own; one pipeline to
one Redis node: every key here has the hash tag ``{ds:stats}``, and starts with ``{`` as
``keys.SUBS_INDEX`` does, so no stream key and no ``keys.META_PATTERN`` match is one):

- into the hash of the current ``BUCKET_SECONDS`` bucket (``{ds:stats}:b:<start, unix s>``,
  expiring ``RETENTION_SECONDS`` after its last write) what its own counters
  (telemetry/metrics.py) grew by since its last tick: ``a`` appends (``ds_appends_total``),
  ``b`` bytes (``ds_appended_bytes_total``), and its live readers
  (``ds_live_connections{mode}``) times the milliseconds since: ``sse``, ``lp``; a bucket's
  sum over every process divided by its length is its average number of readers;
- its live readers now, in ``{ds:stats}:live`` (field: the process, value "<ms> <sse>
  <long-poll>"), summed on read over the processes that reported within ``FRESH_SECONDS``;
- the first process to tick in a bucket (``HSETNX`` of its ``s``) then samples, at each of
  its ticks in that bucket (one process at a time cluster-wide; the bucket keeps the last),
  what is in Redis already and the same for everyone: the archive lag
  (the oldest archive hint: what the archive workers report as ``ds_archive_lag_seconds``
  and ``--write-pause-archive-lag`` reads), the streams due for archiving, whether archive
  and delivery workers run, and the subscription backlog: subscriptions due now in the
  delivery schedules (``keys.due_keys``), plus on one Redis the streams waiting in the
  outbox for their subscribers to be told (a Redis Cluster has one outbox per slot: 16,384
  reads, left out);
- for the streams a console is looking at (``{ds:stats}:watched``: at most ``MAX_WATCHED``,
  each until ``WATCH_SECONDS`` after a console last asked), how many of its own live readers
  wait on each (its fan-out's waiters), in ``{ds:stats}:r:<stream>``: a second round trip,
  made only while a stream is watched and this process has readers of it (or had).

A stream's write rate is sampled by the console's requests for it: each adds the stream's
tail (its size in bytes) and the time to ``{ds:stats}:w:<stream>`` (kept ``SAMPLE_SECONDS``),
and the rate is the growth between samples at least a second apart.

Appends and bytes come from this process' counters, which every recorder of a process
shares (``ProcessCounters``: tests run several gateways in one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.client import Pipeline

from ..concurrency.cancelling import raise_if_cancelled
from ..protocol.models import text
from ..redis_io import keys
from ..redis_io.connections import NotSent
from ..redis_io.outcomes import UNAVAILABLE
from ..redis_io.routing import Queue
from ..redis_io.scripts import Scripts
from ..telemetry import metrics
from ..telemetry.logs import RateLimited

log = logging.getLogger(__name__)
limited = RateLimited(log, every=60.0)

TAG = "{ds:stats}"
TICK_SECONDS = 2.0  # how often each process records (read when a Recorder is made)
BUCKET_SECONDS = 10  # the graphs' resolution
RETENTION_SECONDS = 3600  # how long buckets are kept: the longest window asked for
MAX_MINUTES = RETENTION_SECONDS // 60
DEFAULT_MINUTES = 15
FRESH_SECONDS = 10.0  # a process' live readers count while it reported within this
WATCH_SECONDS = 30.0  # a stream's readers are counted this long after a console asked
MAX_WATCHED = 50  # streams whose readers are counted at once
READERS_TTL_SECONDS = 60  # a watched stream's readers hash, after its last write
SAMPLE_SECONDS = 900  # how long a stream's write samples are kept
MAX_SAMPLES = 1000
SUBSCRIPTIONS_SHOWN = 100  # subscriptions listed at most
SEEN_PER_SCHEDULE = 100  # subscriptions remembered from each schedule per sample
MAX_SEEN = 1000  # subscriptions remembered (those with work scheduled within RETENTION_SECONDS)
_FIELDS = ("a", "b", "sse", "lp", "lag", "adue", "aw", "backlog", "outbox", "sched", "sw", "pat")
_STATE = ("type", "status", "wake", "holder", "attempts", "created_at", "backfill")


def now_ms() -> int:
    return int(time.time() * 1000)


def bucket_start(ms: int) -> int:
    """The start (unix seconds) of the bucket holding ``ms``."""
    return ms // 1000 // BUCKET_SECONDS * BUCKET_SECONDS


def _encoded(sid: str) -> str:
    """A stream id in a key name: ``:`` encoded too, so no key here ends like a meta key."""
    return sid.replace(":", "%3A")


@dataclass(frozen=True)
class StatsKeys:
    """The key names, under one hash tag (``tag``: tests use their own)."""

    tag: str = TAG

    def bucket(self, start: int) -> str:
        return f"{self.tag}:b:{start}"

    @property
    def live(self) -> str:
        return f"{self.tag}:live"

    @property
    def watched(self) -> str:
        return f"{self.tag}:watched"

    @property
    def seen_subscriptions(self) -> str:
        return f"{self.tag}:subs"

    def readers(self, sid: str) -> str:
        return f"{self.tag}:r:{_encoded(sid)}"

    def writes(self, sid: str) -> str:
        return f"{self.tag}:w:{_encoded(sid)}"


# -- this process' counters -----------------------------------------------------------


def _total(metric: Any) -> int:
    return int(sum(s.value for f in metric.collect() for s in f.samples if s.name.endswith("_total")))


class ProcessCounters:
    """What this process' append counters grew by since they were last taken, by any
    recorder of the process; and its live readers now."""

    def __init__(self) -> None:
        self._pid = 0
        self._taken = (0, 0)

    def start(self) -> None:
        """Count from now (once per process: a fork counts afresh)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._taken = self._now()

    @staticmethod
    def _now() -> tuple[int, int]:
        return _total(metrics.APPENDS), _total(metrics.APPENDED_BYTES)

    def take(self) -> tuple[int, int]:
        """(appends, bytes) since the last take."""
        self.start()
        now = self._now()
        grown = (max(0, now[0] - self._taken[0]), max(0, now[1] - self._taken[1]))
        self._taken = now
        return grown

    def give_back(self, appends: int, size: int) -> None:
        """Taken but never sent: the next take has them again."""
        self._taken = (self._taken[0] - appends, self._taken[1] - size)

    @staticmethod
    def live() -> tuple[int, int]:
        """(SSE, long-poll) live reads open in this process."""
        found = {s.labels.get("mode"): s.value for f in metrics.LIVE_CONNECTIONS.collect() for s in f.samples}
        return int(found.get("sse", 0)), int(found.get("long-poll", 0))


PROCESS = ProcessCounters()


# -- recording --------------------------------------------------------------------------


def _failed(what: str, exc: BaseException) -> None:
    """DEBUG while Redis is away (requests and /readyz say so), else a WARNING a minute."""
    level = logging.DEBUG if isinstance(exc, (*UNAVAILABLE, OSError)) else logging.WARNING
    limited.log(level, what, "console statistics: %s: %s", what, exc)


def _first_score(reply: Any) -> float | None:
    """The score of ``ZRANGE key 0 0 WITHSCORES`` (flat, or pairs by the client's callback)."""
    if not reply:
        return None
    first = reply[0]
    if isinstance(first, (list, tuple)):
        return float(first[1])
    return float(reply[1])


def _number(reply: Any) -> int | None:
    return None if isinstance(reply, BaseException) or reply is None else int(reply)


class Recorder:
    """One gateway process' recording task (see the module)."""

    def __init__(
        self,
        scripts: Scripts,
        readers: Callable[[str], int],
        hint_keys: Sequence[str],
        *,
        interval: float | None = None,
        counters: ProcessCounters = PROCESS,
        tag: str = TAG,
    ) -> None:
        self.scripts = scripts
        self.readers = readers
        self.hint_keys = list(hint_keys)
        self.interval = TICK_SECONDS if interval is None else interval
        self.counters = counters
        self.keys = StatsKeys(tag)
        self.process = f"{socket.gethostname()}:{os.getpid()}"  # the live gauges are the process'
        self.instance = f"{self.process}:{secrets.token_hex(3)}"  # a fan-out is one app's
        self._last: int | None = None
        self._offered = -1  # the last bucket this process offered to sample
        self._sampling = -1  # the bucket it samples (it was first to offer)
        self._reported: set[str] = set()  # watched streams it last said it has readers of
        self._stop = asyncio.Event()
        counters.start()

    async def tick(self, now: int | None = None) -> None:
        """Record once (see the module). Raises what Redis raised."""
        now = now_ms() if now is None else now
        step = int(self.interval * 1000)
        span = step if self._last is None else max(0, min(now - self._last, 3 * step))
        self._last = now
        appends, size = self.counters.take()
        sse, long_poll = self.counters.live()
        start = bucket_start(now)
        key, offer = self.keys.bucket(start), start != self._offered
        self._offered = start

        def queue(pipe: Pipeline) -> None:
            if appends:
                pipe.hincrby(key, "a", appends)
            if size:
                pipe.hincrby(key, "b", size)
            pipe.hincrby(key, "sse", sse * span)  # always: a bucket exists while a gateway records
            if long_poll:
                pipe.hincrby(key, "lp", long_poll * span)
            pipe.expire(key, RETENTION_SECONDS)
            pipe.hset(self.keys.live, self.process, f"{now} {sse} {long_poll}")
            pipe.expire(self.keys.live, RETENTION_SECONDS)
            pipe.zrange(self.keys.watched, now, "+inf", byscore=True, offset=0, num=MAX_WATCHED)
            if offer:
                pipe.hsetnx(key, "s", self.process)

        try:
            replies = await self.scripts.route.pipeline(key, queue)
        except NotSent:
            self.counters.give_back(appends, size)
            self._offered = -1
            raise
        if offer and replies[-1]:
            self._sampling = start
        if self._sampling == start:
            await self.sample(key, now)
        watched = replies[-2] if offer else replies[-1]
        await self._report_readers([text(sid) for sid in watched], now)

    async def sample(self, key: str, now: int) -> None:
        """What is the same for every gateway, into bucket ``key``: archive lag and due
        streams, workers running, the subscription backlog."""
        cluster = self.scripts.cluster
        commands: list[tuple[str, list[Any]]] = []
        for hint_key in self.hint_keys:
            commands += [
                (hint_key, ["ZRANGE", hint_key, 0, 0, "WITHSCORES"]),
                (hint_key, ["ZCOUNT", hint_key, "-inf", now]),
            ]
        dues = keys.due_keys(cluster)
        for due in dues:
            commands += [(due, ["ZCOUNT", due, "-inf", now]), (due, ["ZCARD", due])]
            commands.append((due, ["ZRANGE", due, 0, SEEN_PER_SCHEDULE - 1]))
        commands += [
            (keys.ARCHIVE_WORKER_ALIVE, ["EXISTS", keys.ARCHIVE_WORKER_ALIVE]),
            (keys.SUBS_WORKER_ALIVE, ["EXISTS", keys.SUBS_WORKER_ALIVE]),
            (keys.SUBS_INDEX, ["HLEN", keys.SUBS_INDEX]),
        ]
        if not cluster:
            commands.append((keys.SUBS_OUTBOX, ["ZCOUNT", keys.SUBS_OUTBOX, "-inf", now]))
        replies = await self.scripts.command_each(commands)
        n = len(self.hint_keys)
        hints, schedules, rest = (
            replies[: 2 * n],
            replies[2 * n : 2 * n + 3 * len(dues)],
            replies[2 * n + 3 * len(dues) :],
        )
        found: dict[Any, Any] = {}
        if not any(isinstance(r, BaseException) for r in hints):
            firsts = [_first_score(r) for r in hints[0::2]]
            oldest = min((s for s in firsts if s is not None), default=None)
            found["lag"] = max(0, now - int(oldest)) if oldest is not None else 0
            found["adue"] = sum(int(r) for r in hints[1::2])
        seen: dict[str, int] = {}
        if not any(isinstance(r, BaseException) for r in schedules):
            found["backlog"] = sum(int(r) for r in schedules[0::3])
            found["sched"] = sum(int(r) for r in schedules[1::3])
            seen = {text(sub): now for reply in schedules[2::3] for sub in reply}
        for name, reply in zip(("aw", "sw", "pat", "outbox"), rest, strict=False):
            value = _number(reply)
            if value is not None:
                found[name] = value
        subs = self.keys.seen_subscriptions

        def queue(pipe: Pipeline) -> None:
            if found:
                pipe.hset(key, mapping=found)
            if seen:  # remembered a while: the list shows them between their wakes too
                pipe.zadd(subs, seen)
                pipe.zremrangebyscore(subs, "-inf", now - RETENTION_SECONDS * 1000)
                pipe.zremrangebyrank(subs, 0, -(MAX_SEEN + 1))
                pipe.expire(subs, RETENTION_SECONDS)

        if found or seen:
            await self.scripts.route.pipeline(key, queue)

    async def _report_readers(self, watched: list[str], now: int) -> None:
        counts = {sid: self.readers(sid) for sid in watched}
        changed = {sid: n for sid, n in counts.items() if n or sid in self._reported}
        self._reported = {sid for sid, n in counts.items() if n}
        if not changed:
            return

        def queue(pipe: Pipeline) -> None:
            for sid, n in changed.items():
                key = self.keys.readers(sid)
                if n:
                    pipe.hset(key, self.instance, f"{now} {n}")
                    pipe.expire(key, READERS_TTL_SECONDS)
                else:
                    pipe.hdel(key, self.instance)

        await self.scripts.route.pipeline(self.keys.watched, queue)

    def stop(self) -> None:
        """Make ``run`` return, after one last tick (an Event, not a cancel)."""
        self._stop.set()

    async def run(self, ready: Callable[[], bool] = lambda: True) -> None:
        """Tick every ``interval`` until ``stop`` (not before ``ready``: a Redis that has
        not passed the start-up checks gets no writes); then once more, briefly, so the
        last counts are not lost."""
        while not self._stop.is_set():
            if ready():
                try:
                    await self.tick()
                except Exception as exc:
                    raise_if_cancelled()  # stopping, the CancelledError lost in a library
                    _failed("not recorded", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)
        if ready():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.tick(), 1.0)


# -- reading ----------------------------------------------------------------------------


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _rate(count: int, ms: int) -> float:
    return round(count * 1000 / ms, 3) if ms > 0 else 0.0


def _fresh(values: Iterable[tuple[str, str]], now: int) -> tuple[list[list[int]], list[str]]:
    """The ``"<ms> <n> ..."`` values reported within FRESH_SECONDS (their numbers), and
    the fields of the others."""
    fresh, stale = [], []
    for field, value in values:
        ms, *numbers = (int(n) for n in value.split())
        if now - ms <= FRESH_SECONDS * 1000:
            fresh.append(numbers)
        else:
            stale.append(field)
    return fresh, stale


def _pairs(reply: Any) -> list[tuple[str, Any]]:
    """A hash or sorted set reply as (text, value) pairs, whatever the client made of it."""
    if isinstance(reply, dict):
        return [(text(k), v) for k, v in reply.items()]
    if reply and isinstance(reply[0], (list, tuple)):
        return [(text(k), v) for k, v in reply]
    return [(text(reply[i]), reply[i + 1]) for i in range(0, len(reply), 2)]


class Reader:
    """What the JSON endpoints answer, read from Redis (see the module)."""

    def __init__(self, scripts: Scripts, tag: str = TAG) -> None:
        self.scripts = scripts
        self.keys = StatsKeys(tag)

    def recorder(self, readers: Callable[[str], int]) -> Recorder:
        """This process' recorder, into the keys read here (``readers``: a stream's live
        readers in this process)."""
        hint_keys = keys.archive_hint_keys(self.scripts.cluster)
        return Recorder(self.scripts, readers, hint_keys, tag=self.keys.tag)

    async def _pipeline(self, queue: Queue) -> list[Any]:
        return await self.scripts.route.pipeline(self.keys.live, queue)

    async def _forget(self, key: str, fields: list[str]) -> None:
        """Fields of processes gone: removed by whoever reads them (best effort)."""
        if fields:
            with contextlib.suppress(Exception):
                await self._pipeline(lambda pipe: pipe.hdel(key, *fields))

    async def _forget_zset(self, key: str, members: list[str]) -> None:
        if members:
            with contextlib.suppress(Exception):
                await self._pipeline(lambda pipe: pipe.zrem(key, *members))

    async def overview(self, minutes: int = DEFAULT_MINUTES, now: int | None = None) -> dict[str, Any]:
        """The last ``minutes``: a series per bucket (complete buckets; the one under way
        counts in the totals only), and the figures now."""
        now = now_ms() if now is None else now
        current = bucket_start(now)
        count = max(1, minutes * 60 // BUCKET_SECONDS)
        starts = [current - BUCKET_SECONDS * (count - i) for i in range(count)]

        def queue(pipe: Pipeline) -> None:
            for start in [*starts, current]:
                pipe.hmget(self.keys.bucket(start), _FIELDS)
            pipe.hgetall(self.keys.live)

        *buckets, live = await self._pipeline(queue)
        rows = [dict(zip(_FIELDS, (_int(v) for v in row), strict=True)) for row in buckets]
        fresh, stale = _fresh(((text(k), text(v)) for k, v in live.items()), now)
        await self._forget(self.keys.live, stale)
        span = BUCKET_SECONDS * 1000
        series: dict[str, list[Any]] = {
            "start_ms": [s * 1000 for s in starts],
            "appends_per_s": [],
            "bytes_per_s": [],
            "sse": [],
            "long_poll": [],
            "archive_lag_s": [],
            "subscription_backlog": [],
        }
        for row in rows[:-1]:
            recorded = row["sse"] is not None  # every recording process writes it
            series["appends_per_s"].append(_rate(row["a"] or 0, span) if recorded else None)
            series["bytes_per_s"].append(_rate(row["b"] or 0, span) if recorded else None)
            series["sse"].append(round((row["sse"] or 0) / span, 2) if recorded else None)
            series["long_poll"].append(round((row["lp"] or 0) / span, 2) if recorded else None)
            series["archive_lag_s"].append(None if row["lag"] is None else row["lag"] / 1000)
            series["subscription_backlog"].append(_backlog(row))
        last_complete = rows[-2] if len(rows) > 1 else {}
        # What one gateway sampled in the current bucket or the two before (not an old figure).
        sampled = next(
            (row for row in reversed(rows[-3:]) if any(row[f] is not None for f in _SAMPLED)), None
        )
        return {
            "now_ms": now,
            "bucket_seconds": BUCKET_SECONDS,
            "minutes": minutes,
            "processes": len(fresh),
            "series": series,
            "totals": {"appends": sum(r["a"] or 0 for r in rows), "bytes": sum(r["b"] or 0 for r in rows)},
            "now": {
                "appends_per_s": _rate(last_complete.get("a") or 0, span),
                "bytes_per_s": _rate(last_complete.get("b") or 0, span),
                "sse": sum(n[0] for n in fresh),
                "long_poll": sum(n[1] for n in fresh),
                "archive": _archive(sampled),
                "subscriptions": _subscriptions(sampled),
            },
        }

    async def stream(self, sid: str, tail: int, now: int | None = None) -> dict[str, Any]:
        """One stream's live readers (on every gateway) and write rate, and it watched for
        ``WATCH_SECONDS`` more; ``tail``: its size now, sampled."""
        now = now_ms() if now is None else now
        watched, readers, writes = self.keys.watched, self.keys.readers(sid), self.keys.writes(sid)

        def queue(pipe: Pipeline) -> None:
            pipe.zadd(watched, {sid: now + int(WATCH_SECONDS * 1000)})
            pipe.zremrangebyscore(watched, "-inf", now)
            pipe.zremrangebyrank(watched, 0, -(MAX_WATCHED + 1))  # the soonest to end go first
            pipe.expire(watched, RETENTION_SECONDS)
            pipe.hsetnx(readers, "_since", now)
            pipe.expire(readers, READERS_TTL_SECONDS)
            pipe.hgetall(readers)
            pipe.zadd(writes, {f"{now // 1000}:{tail}": now}, nx=True)  # once a second at most
            pipe.zremrangebyscore(writes, "-inf", now - SAMPLE_SECONDS * 1000)
            pipe.zremrangebyrank(writes, 0, -(MAX_SAMPLES + 1))
            pipe.expire(writes, SAMPLE_SECONDS)
            pipe.zrange(writes, 0, -1, withscores=True)

        replies = await self._pipeline(queue)
        counted = {text(k): text(v) for k, v in replies[6].items()}
        since = int(counted.pop("_since", now))
        fresh, stale = _fresh(counted.items(), now)
        await self._forget(readers, stale)
        total = sum(n[0] for n in fresh)
        # Gateways learn of the watch at their next tick: until then zero means "not known yet".
        counting = now - since < (2 * TICK_SECONDS + 1) * 1000 and not total
        samples = sorted((int(score), int(text(member).partition(":")[2])) for member, score in replies[-1])
        kept: list[tuple[int, int]] = []
        for at, size in samples:
            if not kept or at - kept[-1][0] >= 1000:
                kept.append((at, size))
        rates = [
            round((b - a_size) * 1000 / (at - a_at), 3) if b >= a_size else None
            for (a_at, a_size), (at, b) in zip(kept, kept[1:], strict=False)
        ]
        return {
            "now_ms": now,
            "readers": None if counting else total,
            "readers_since_ms": since,
            "bytes_per_s": rates[-1] if rates else None,
            "series": {"at_ms": [at for at, _ in kept[1:]], "bytes_per_s": rates},
            "sampled_since_ms": kept[0][0] if kept else now,
        }

    async def subscriptions(
        self, visible: Callable[[str], bool], limit: int = SUBSCRIPTIONS_SHOWN, now: int | None = None
    ) -> dict[str, Any]:
        """The subscriptions a gateway can find without a SCAN: those with a pattern (the
        pattern index), those with something scheduled (the delivery schedules) and those
        that had within the last hour (remembered by the samples), that ``visible`` lets
        through; at most ``limit``, by id, each with its state."""
        now = now_ms() if now is None else now
        cluster = self.scripts.cluster
        dues = keys.due_keys(cluster)
        index = keys.SUBS_INDEX
        commands: list[tuple[str, list[Any]]] = [
            (index, ["HLEN", index]),
            (index, ["HSCAN", index, 0, "COUNT", limit]),
        ]
        for due in dues:
            commands += [(due, ["ZCARD", due]), (due, ["ZCOUNT", due, "-inf", now])]
            commands.append((due, ["ZRANGE", due, 0, limit - 1, "WITHSCORES"]))
        seen_key = self.keys.seen_subscriptions
        commands.append((seen_key, ["ZRANGE", seen_key, 0, -1]))
        *replies, seen = _checked(await self.scripts.command_each(commands))
        patterns = {k: text(v) for k, v in _pairs(_scan_body(replies[1]))}
        scheduled: dict[str, int] = {}
        for reply in replies[4::3]:
            scheduled.update((k, int(float(v))) for k, v in _pairs(reply))
        listed = [
            sub for sub in sorted(set(patterns) | set(scheduled) | {text(s) for s in seen}) if visible(sub)
        ]
        shown = listed[:limit]
        # More than these: past the limit, or some the bounded reads above did not return.
        more = len(listed) > limit or int(replies[0]) > len(patterns)
        more = more or any(int(n) > limit for n in replies[2::3])
        commands = []
        for sub in shown:
            state, links, pending, _ = keys.sub_keys(sub, cluster)
            commands += [
                (state, ["HMGET", state, *_STATE]),
                (links, ["HLEN", links]),
                (pending, ["HLEN", pending]),
            ]
        states = _checked(await self.scripts.command_each(commands))
        items, gone = [], []
        for i, sub in enumerate(shown):
            values = dict(zip(_STATE, (None if v is None else text(v) for v in states[3 * i]), strict=True))
            if values["type"] is None:  # deleted
                gone.append(sub)
                continue
            at = scheduled.get(sub)
            if values["status"] == "failed":
                shown_state = "failed"
            elif values["wake"]:
                shown_state = "waking"  # a wake in flight: delivered, or waiting for its claim
            elif at is not None:
                shown_state = "due" if at <= now else "scheduled"
            else:
                shown_state = "idle"
            items.append(
                {
                    "id": sub,
                    "type": values["type"],
                    "state": shown_state,
                    "pattern": patterns.get(sub) or None,
                    "streams": int(states[3 * i + 1]),
                    "pending_streams": int(states[3 * i + 2]),
                    "attempts": int(values["attempts"] or 0),
                    "holder": values["holder"] or None,
                    "backfill": values["backfill"] == "1",  # a pattern's existing streams: to link
                    "next_at_ms": at,
                    "created_at": values["created_at"],
                }
            )
        await self._forget_zset(seen_key, gone)
        return {
            "now_ms": now,
            "subscriptions": items,
            "patterns": int(replies[0]),
            "scheduled": sum(int(n) for n in replies[2::3]),
            "due": sum(int(n) for n in replies[3::3]),
            "more": more,
        }


_SAMPLED = ("lag", "adue", "aw", "backlog", "outbox", "sched", "sw", "pat")


def _backlog(row: dict[str, int | None]) -> int | None:
    if row["backlog"] is None:
        return None
    return row["backlog"] + (row["outbox"] or 0)


def _archive(row: dict[str, int | None] | None) -> dict[str, Any]:
    if row is None:
        return {"lag_seconds": None, "due_streams": None, "workers": None}
    lag = row["lag"]
    return {
        "lag_seconds": None if lag is None else lag / 1000,
        "due_streams": row["adue"],
        "workers": None if row["aw"] is None else bool(row["aw"]),
    }


def _subscriptions(row: dict[str, int | None] | None) -> dict[str, Any]:
    if row is None:
        return {
            "backlog": None,
            "due": None,
            "outbox": None,
            "scheduled": None,
            "patterns": None,
            "workers": None,
        }
    return {
        "backlog": _backlog(row),
        "due": row["backlog"],
        "outbox": row["outbox"],  # None on Redis Cluster (one outbox per slot)
        "scheduled": row["sched"],
        "patterns": row["pat"],
        "workers": None if row["sw"] is None else bool(row["sw"]),
    }


def _scan_body(reply: Any) -> Any:
    """HSCAN's entries, as a (cursor, entries) pair or list."""
    return reply[1]


def _checked(replies: list[Any]) -> list[Any]:
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies
