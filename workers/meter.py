"""The usage meter's flusher: closed metering hours moved from Redis to Parquet, each
count exactly once, whatever moment a worker is killed at.

With ``--tenants`` the write scripts count each tenant's usage atomically with the write
(lua/_tenants.lua) into one Redis hash per UTC hour, ``keys.meter(hour)``
(``ds:meter:<hour>``, hour = Unix seconds of its start), fields ``'<tenant> <counter>'``
-> count. The archive worker runs a ``Meter`` beside its archiving loop; every
~``INTERVAL_SECONDS`` (jittered) it moves each *closed* hour (found by name, and by a rare
scan: ``LOOKBACK_HOURS``), one whose end is
``GRACE_SECONDS`` past (late counts, e.g. a gateway's ``bytes_out`` added after the hour,
land first). Per hour:

1. *take* (one MULTI, WATCHing the hour's key and ``keys.METER_FLUSHING``): record
   ``METER_FLUSHING[hour] = <part key>`` and RENAME the hour's hash to that part key
   (``keys.meter_part(hour, part)``, part a new uuid hex). A count is either in the hour's
   key or in the part, never both; one written later starts a new hour key, taken later
   as another part of the same hour. A part is never written to again: it is immutable;
2. *write* the part's rows as ``_usage/hour=<YYYY-MM-DDTHH>/<part>.parquet`` under the
   archive root (``Archive.put``: whole or not at all). The name is the part's, so writing
   it again (after a crash, or by a second worker finishing the same part) replaces it
   with the same rows: overwritten, never duplicated. A part found empty or gone is not
   written (its file, if any, was written from it before);
3. *finish* (one MULTI, WATCHing ``METER_FLUSHING``, only while it still names this part):
   delete the part and its ``METER_FLUSHING`` entry.

A worker killed between 1 and 3 leaves ``METER_FLUSHING`` naming the part: the next
round (any worker's) finishes that part before it takes the hour again. So every count
is in exactly one file, once: exactly-once by at-least-once writes under idempotent names.

Several workers need no lock, and there is none: the take is one MULTI (two takes of an
hour: one wins, the other sees its part and finishes it too, writing identical bytes),
a finish deletes only the part ``METER_FLUSHING`` still names (a slow worker never drops
a newer part of the hour). A worker paused anywhere for any time is just as harmless.
What could count twice is a Redis that loses an acknowledged take (an async replica
promoted after the file was written): then the hour's counts come back and are taken again.

Hours are by the gateways' clocks (they pick the hour key) and closed by this worker's:
``GRACE_SECONDS`` covers clock skew and counts added late.

Usage files (read by ``workers/usage_bill.py``), one row per (tenant, counter) of a part:

    hour     timestamp[ms, tz=UTC]  the start of the metered hour
    tenant   string                 the tenant's name
    counter  string                 appends, bytes_in, streams_created, streams_deleted, ...
    value    int64                  the part's count (an hour's total: the sum over its parts)

Spark, and the archive's own readers, skip ``_usage/`` when they read the archive root
(Hadoop skips names starting with ``_``); archive workers delete only the files their
segment sets name (``date=.../bucket=.../``), never ``_usage/``.

``DURABLE_STREAMS_METER_INTERVAL_SECONDS`` (read once, at import) changes the 30 s
between rounds: for tests; not a setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import random
import time
import uuid

import pyarrow as pa
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from gateway.archive.files import Archive
from gateway.archive.usage import usage_file
from gateway.concurrency.cancelling import raise_if_cancelled
from gateway.protocol.models import text
from gateway.redis_io import keys
from gateway.redis_io.connections import Client, scan_pages
from gateway.redis_io.preflight import reason
from gateway.telemetry import metrics
from gateway.telemetry.logs import RateLimited

from .archive_scan import unavailable

log = logging.getLogger("durable_streams.meter")
limited = RateLimited(log, every=60.0)

GRACE_SECONDS = 120.0  # after an hour ends, before it is moved: late counts land first
INTERVAL_SECONDS = float(os.environ.get("DURABLE_STREAMS_METER_INTERVAL_SECONDS") or 30.0)
WATCH_TRIES = 20  # a MULTI losing its WATCH this often in a row: next round
# Hours are looked up by name (the last LOOKBACK_HOURS: one EXISTS each, pipelined), and the
# whole keyspace is scanned once every FULL_SCAN_ROUNDS rounds (~1 h), and at a worker's first:
# a SCAN of a large Redis every 30 s would cost more than everything else the meter does. The
# scan finds what names miss: hours left while no worker ran for days, a gateway's clock far off.
LOOKBACK_HOURS = 48
FULL_SCAN_ROUNDS = 120

SCHEMA = pa.schema(
    [
        pa.field("hour", pa.timestamp("ms", tz="UTC"), nullable=False),
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("counter", pa.string(), nullable=False),
        pa.field("value", pa.int64(), nullable=False),
    ]
)


def part_of(part_key: str) -> str:
    """The part (uuid hex) a part key (``keys.meter_part``) names: its last field."""
    return part_key.rsplit(":", 1)[-1]


def hour_of(key: str) -> int | None:
    """The hour of a meter key (``keys.meter``), None for another name."""
    rest = key.removeprefix(keys.METER_PREFIX)
    return int(rest) if rest != key and rest.isdigit() else None


def usage_table(hour: int, fields: dict[bytes | str, bytes | str]) -> pa.Table:
    """A part's hash as rows, sorted (the same part: the same bytes). A field that is no
    '<tenant> <counter>' -> integer is left out, with a warning: none is ever written so."""
    rows: list[tuple[str, str, int]] = []
    for raw_field, raw_value in fields.items():
        tenant, _, counter = text(raw_field).partition(" ")
        try:
            value = int(text(raw_value))
        except ValueError:
            value = None
        if not tenant or not counter or value is None:
            log.warning("meter hour %d: left out %r = %r (not '<tenant> <counter>' -> count)",
                        hour, raw_field, raw_value)  # fmt: skip
            continue
        rows.append((tenant, counter, value))
    rows.sort()
    start = hour * 1000
    return pa.table(
        {
            "hour": pa.array([start] * len(rows), SCHEMA.field("hour").type),
            "tenant": pa.array([r[0] for r in rows], pa.string()),
            "counter": pa.array([r[1] for r in rows], pa.string()),
            "value": pa.array([r[2] for r in rows], pa.int64()),
        },
        schema=SCHEMA,
    )


def parquet_bytes(table: pa.Table) -> bytes:
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


class Meter:
    """Moves closed meter hours to usage files (see the module): ``flush_once`` one round,
    ``run`` rounds until stopped."""

    def __init__(
        self,
        redis: Client,
        archive: Archive,
        *,
        interval: float = INTERVAL_SECONDS,
        grace: float = GRACE_SECONDS,
    ) -> None:
        if not isinstance(redis, aioredis.Redis):  # (--tenants refuses --redis-cluster)
            raise TypeError("the meter needs one Redis (MULTI over its keys), not a Redis Cluster")
        self.redis = redis
        self.archive = archive
        self.interval = interval
        self.grace = grace
        self.rounds = 0
        self.older: set[int] = set()  # hours before the lookback the last scan found: looked up by name too

    async def run(self, stop: asyncio.Event) -> None:
        """A round now and then every ``interval`` (± 20 %: workers started together drift
        apart) until ``stop``; a failed round is logged (rate-limited) and the next retries."""
        pause = random.uniform(0, min(1.0, self.interval))  # soon after a start: a crash's part
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
            if stop.is_set():
                break
            try:
                await self.flush_once(time.time())
            except Exception as exc:
                raise_if_cancelled()  # stopping, the CancelledError lost in a library
                limited.log(logging.WARNING, "flush", "moving usage to %s failed (retried in %.0f s): %s",
                            self.archive.url, self.interval, reason(exc),
                            exc_info=None if unavailable(exc) else exc)  # Redis away: one line  # fmt: skip
            pause = self.interval * random.uniform(0.8, 1.2)

    async def flush_once(self, now: float) -> int:
        """Finish the parts a lost round left, then move every hour closed at ``now`` (Unix
        seconds). Returns how many usage files were written."""
        written = 0
        left = await self.redis.hgetall(keys.METER_FLUSHING)
        for field, left_key in sorted(left.items()):
            if text(field).isdigit():  # (nothing else is written there)
                written += await self._finish(int(text(field)), text(left_key))
        scan = self.rounds % FULL_SCAN_ROUNDS == 0
        hours = await (self._every_hour(now) if scan else self._hours_by_name(now))
        self.rounds += 1
        closed = [h + keys.METER_HOUR_SECONDS + self.grace for h in hours]
        metrics.METER_BEHIND.set(max(0.0, now - min((c for c in closed if c <= now), default=now)))
        for hour in sorted(hours):
            if now < hour + keys.METER_HOUR_SECONDS + self.grace:
                continue  # still open, or late counts may come
            for _ in range(3):  # a part another worker took first, then the hour's own
                part_key, fresh = await self._take(hour)
                if part_key is None:
                    break
                written += await self._finish(hour, part_key)
                if fresh:
                    break
        return written

    async def _every_hour(self, now: float) -> set[int]:
        """The hours that have a key, from a scan of the whole keyspace."""
        hours: set[int] = set()
        async for page in scan_pages(self.redis, keys.METER_PREFIX + "*"):
            hours.update(h for h in (hour_of(text(k)) for k in page) if h is not None)
        self.older = {h for h in hours if h < self._lookback(now)}
        return hours

    async def _hours_by_name(self, now: float) -> set[int]:
        """The hours that have a key among the last LOOKBACK_HOURS and the older ones the
        last scan found (until they are gone: ``ds_meter_behind_seconds`` keeps seeing them)."""
        names = [*range(self._lookback(now), keys.meter_hour(now) + 1, keys.METER_HOUR_SECONDS), *self.older]
        async with self.redis.pipeline(transaction=False) as pipe:
            for hour in names:
                pipe.exists(keys.meter(hour))
            found = await pipe.execute()
        hours = {hour for hour, n in zip(names, found, strict=True) if n}
        self.older &= hours
        return hours

    @staticmethod
    def _lookback(now: float) -> int:
        return keys.meter_hour(now) - (LOOKBACK_HOURS - 1) * keys.METER_HOUR_SECONDS

    async def _take(self, hour: int) -> tuple[str | None, bool]:
        """The hour's counts renamed to a new part recorded in ``METER_FLUSHING``: (its key,
        True). (The part recorded already, False): it is to be finished first. (None, False):
        nothing to take."""
        source, field = keys.meter(hour), str(hour)
        for _ in range(WATCH_TRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(keys.METER_FLUSHING, source)
                    current = await pipe.hget(keys.METER_FLUSHING, field)
                    if current is not None:
                        return text(current), False
                    if not await pipe.exists(source):
                        return None, False
                    part_key = keys.meter_part(hour, uuid.uuid4().hex)
                    pipe.multi()
                    pipe.hset(keys.METER_FLUSHING, field, part_key)
                    pipe.rename(source, part_key)
                    await pipe.execute()
                    return part_key, True
                except WatchError:
                    continue  # a late count, or another worker's take or finish: look again
        raise RuntimeError(f"meter hour {hour}: could not take it in {WATCH_TRIES} tries")

    async def _finish(self, hour: int, part_key: str) -> int:
        """Write a taken part's file (unless the part is gone or empty), then forget the
        part. Returns the files written (0 or 1)."""
        fields = await self.redis.hgetall(part_key)
        written = 0
        if fields:
            table = usage_table(hour, fields)
            if table.num_rows:
                await asyncio.to_thread(self._write, usage_file(hour, part_of(part_key)), table)
                written = 1
        await self._forget(hour, part_key)
        return written

    def _write(self, file: str, table: pa.Table) -> None:
        self.archive.put(file, parquet_bytes(table))  # (a thread's: encoding too is off the loop)

    async def _forget(self, hour: int, part_key: str) -> None:
        """Delete the part and its ``METER_FLUSHING`` entry, at once, if the entry still names
        it: else another worker did (and may have taken a newer part of the hour since)."""
        field = str(hour)
        for _ in range(WATCH_TRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(keys.METER_FLUSHING)
                    current = await pipe.hget(keys.METER_FLUSHING, field)
                    if current is None or text(current) != part_key:
                        return
                    pipe.multi()
                    pipe.delete(part_key)
                    pipe.hdel(keys.METER_FLUSHING, field)
                    await pipe.execute()
                    return
                except WatchError:
                    continue  # another hour's take or finish: look again
        raise RuntimeError(f"meter hour {hour}: could not finish {part_key} in {WATCH_TRIES} tries")
