"""The usage meter (workers/meter.py) and the bill (workers/usage_bill.py).

A gateway with tenants counts what its clients did; a flush moves the closed hours to
Parquet, every count once: through a real gateway, with flushes failing at each step in
process, with ``durable-streams archive`` processes SIGKILLed mid-flush while late counts
arrive, with two flushers at once. Then the bill, with pyarrow and with Spark."""

from __future__ import annotations

import asyncio
import io
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, date, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.archive.usage import USAGE_DIR, hour_dir, usage_file
from gateway.redis_io import keys, layout
from gateway.redis_io.limits import STEP_BYTES
from gateway.telemetry import metrics
from workers import usage_bill
from workers.meter import FULL_SCAN_ROUNDS, GRACE_SECONDS, Meter, part_of, usage_table

from .conftest import ready_worker, serving, stop_gracefully

TEXT = {"Content-Type": "text/plain"}
SCRIPTS_COUNT = ("appends", "bytes_in", "streams_created", "streams_deleted")  # lua/_tenants.lua
CLOSED = 3600 + GRACE_SECONDS + 1  # an hour is closed this long after it starts
Totals = Counter[tuple[int, str, str]]  # (hour, tenant, counter) -> count


def _name() -> str:
    return f"m{uuid.uuid4().hex[:10]}"


def _usage(archive_dir: Path) -> tuple[Totals, list[str]]:
    """Every usage file's rows summed, and the files (relative to the archive root). Each
    file's rows are checked: its hour's, one per (tenant, counter)."""
    archive = Archive(str(archive_dir))
    files = [f for f in archive.files() if f.startswith(f"{USAGE_DIR}/")]
    totals: Totals = Counter()
    for file in files:
        table = archive.read(file)
        assert table.schema.names == ["hour", "tenant", "counter", "value"]
        rows = table.to_pylist()
        assert len({(r["tenant"], r["counter"]) for r in rows}) == len(rows), file
        for row in rows:
            hour = int(row["hour"].timestamp())
            assert file.startswith(f"{USAGE_DIR}/{hour_dir(hour)}/"), file
            totals[(hour, row["tenant"], row["counter"])] += row["value"]
    return totals, files


def _mine(totals: Totals, tenants: set[str]) -> Totals:
    return Counter({k: v for k, v in totals.items() if k[1] in tenants and v})


def _of(files: list[str], hours: list[int]) -> list[str]:
    """The files of ``hours`` (a flush also moves other tests' closed hours)."""
    return [f for f in files if any(f.startswith(f"{USAGE_DIR}/{hour_dir(h)}/") for h in hours)]


async def _leftovers(redis: aioredis.Redis, hours: set[int]) -> list[str]:
    """What Redis still holds of the meter of ``hours``: their keys, parts, flushing entries."""
    found = [keys.meter(h) for h in hours if await redis.exists(keys.meter(h))]
    found += [
        f"{keys.METER_FLUSHING}[{h}]" for h in hours if await redis.hexists(keys.METER_FLUSHING, str(h))
    ]
    for h in hours:
        found += [k.decode() async for k in redis.scan_iter(match=keys.meter_part(h, "*"))]
    return found


async def _count(
    redis: aioredis.Redis, expected: Totals, hour: int, tenant: str, counter: str, n: int
) -> None:
    await redis.hincrby(keys.meter(hour), f"{tenant} {counter}", n)
    expected[(hour, tenant, counter)] += n


# -- through a gateway ----------------------------------------------------------------


async def test_a_gateways_counts_reach_parquet_exactly(redis_url, redis, http, tmp_path) -> None:
    a, b = _name(), _name()
    expected: Counter[tuple[str, str]] = Counter()
    first_hour = keys.meter_hour(time.time())
    async with serving(redis_url, tenants=True, tenant_paths=f"{a}/={a} {b}/={b}") as base:
        rng = random.Random(7)
        for tenant in (a, b):
            for n in range(3):
                body = b"x" * n  # a create's body is written: bytes_in, not an append
                async with http.put(f"{base}/{tenant}/s{n}", data=body, headers=TEXT) as r:
                    assert r.status == 201
                expected[(tenant, "streams_created")] += 1
                expected[(tenant, "bytes_in")] += len(body)
            async with http.put(f"{base}/{tenant}/s0", headers=TEXT) as r:
                assert r.status == 200  # the same stream again: no new one
            for _ in range(25 if tenant == a else 12):
                body = os.urandom(rng.randrange(1, 300))
                async with http.post(f"{base}/{tenant}/s{rng.randrange(3)}", data=body, headers=TEXT) as r:
                    assert r.status == 204
                expected[(tenant, "appends")] += 1
                expected[(tenant, "bytes_in")] += len(body)
            async with http.delete(f"{base}/{tenant}/s2") as r:
                assert r.status == 204
            expected[(tenant, "streams_deleted")] += 1
            async with http.post(f"{base}/{tenant}/s2", data=b"late", headers=TEXT) as r:
                assert r.status == 404  # not stored: not counted
        big = os.urandom(STEP_BYTES + 1000)  # a large append (append_part.lua's steps): one append
        async with http.post(f"{base}/{a}/s1", data=big, headers=TEXT) as r:
            assert r.status == 204
        expected[(a, "appends")] += 1
        expected[(a, "bytes_in")] += len(big)
    hours = set(range(first_hour, keys.meter_hour(time.time()) + 1, 3600))

    archive_dir = tmp_path / "archive"
    meter = Meter(redis, Archive(str(archive_dir)))
    assert await meter.flush_once(time.time() + CLOSED) >= 1
    totals, files = _usage(archive_dir)
    # The scripts' counters, exactly (gateways add others, e.g. requests_*: those pass through).
    got = Counter({(t, c): v for (_, t, c), v in _mine(totals, {a, b}).items() if c in SCRIPTS_COUNT})
    assert got == expected
    assert len({Path(f).name for f in files}) == len(files)  # one file a part
    assert await _leftovers(redis, hours) == []


# -- crashes, in process ------------------------------------------------------------


class Killed(Exception):
    """A worker's death, injected."""


async def _fill(redis: aioredis.Redis, hours: list[int], tenants: list[str], expected: Totals) -> None:
    rng = random.Random(len(expected))
    for hour in hours:
        for tenant in tenants:
            for counter in ("appends", "bytes_in", "streams_created", "requests_read"):
                for _ in range(2):
                    await _count(redis, expected, hour, tenant, counter, rng.randrange(1, 10_000))


def _old_hours(n: int) -> list[int]:
    """``n`` hours long closed, of this test alone (the Redis is the session's)."""
    start = keys.meter_hour(time.time()) - random.randrange(200, 20_000) * 3600
    return [start + i * 3600 for i in range(n)]


async def test_a_flush_killed_after_its_file_is_finished_once(redis, tmp_path, monkeypatch) -> None:
    tenants, hours, expected = [_name(), _name()], _old_hours(2), Counter()
    await _fill(redis, hours, tenants, expected)
    archive_dir = tmp_path / "archive"

    first = Meter(redis, Archive(str(archive_dir)))
    forget = first._forget

    async def killed(hour: int, part_key: str) -> None:  # (others' hours, if any, go on)
        if hour in hours:
            raise Killed
        await forget(hour, part_key)

    monkeypatch.setattr(first, "_forget", killed)  # the file is written, the part not deleted
    with pytest.raises(Killed):
        await first.flush_once(time.time())
    taken = {int(h): v.decode() for h, v in (await redis.hgetall(keys.METER_FLUSHING)).items()}
    hour = next(h for h in hours if h in taken)
    part = part_of(taken[hour])
    assert await redis.exists(taken[hour]) and not await redis.exists(keys.meter(hour))
    assert _of(_usage(archive_dir)[1], hours) == [usage_file(hour, part)]
    await _count(redis, expected, hour, tenants[0], "appends", 5)  # late: a new key, another part

    assert await Meter(redis, Archive(str(archive_dir))).flush_once(time.time()) >= 3
    totals, files = _usage(archive_dir)
    assert _mine(totals, set(tenants)) == expected
    mine = _of(files, hours)
    assert len(mine) == 3 and usage_file(hour, part) in mine  # the part's file rewritten, not doubled
    assert await _leftovers(redis, set(hours)) == []


async def test_a_flush_killed_before_its_file_is_finished_once(redis, tmp_path, monkeypatch) -> None:
    tenants, hours, expected = [_name()], _old_hours(1), Counter()
    await _fill(redis, hours, tenants, expected)
    archive_dir = tmp_path / "archive"
    archive = Archive(str(archive_dir))

    put = archive.put

    def killed(file: str, data: bytes) -> None:  # (others' hours, if any, go on)
        if file.startswith(f"{USAGE_DIR}/{hour_dir(hours[0])}/"):
            raise Killed
        put(file, data)

    monkeypatch.setattr(archive, "put", killed)  # taken, not written
    with pytest.raises(Killed):
        await Meter(redis, archive).flush_once(time.time())
    part_key = (await redis.hget(keys.METER_FLUSHING, str(hours[0]))).decode()
    assert await redis.exists(part_key) and _of(_usage(archive_dir)[1], hours) == []

    assert await Meter(redis, Archive(str(archive_dir))).flush_once(time.time()) >= 1
    totals, files = _usage(archive_dir)
    assert _mine(totals, set(tenants)) == expected
    assert usage_file(hours[0], part_of(part_key)) in files
    assert await _leftovers(redis, set(hours)) == []


async def test_a_slow_workers_finish_leaves_a_newer_part_alone(redis, tmp_path, monkeypatch) -> None:
    """Worker 1 wrote part 1's file and stalls; worker 2 finishes part 1, takes the hour's
    late counts as part 2 and stalls too; then worker 1 goes on: its finish must not drop
    part 2 (it is no longer the part the hour's entry names)."""
    tenants, hours, expected = [_name()], _old_hours(1), Counter()
    hour = hours[0]
    await _fill(redis, hours, tenants, expected)
    archive_dir = tmp_path / "archive"
    one, two = Meter(redis, Archive(str(archive_dir))), Meter(redis, Archive(str(archive_dir)))
    forget = Meter._forget
    stalled: dict[str, str] = {}

    def stalling(meter: Meter, name: str, unless: str | None = None) -> None:
        async def stall(h: int, part_key: str) -> None:
            if h == hour and part_key != unless:
                stalled[name] = part_key
                raise Killed
            await forget(meter, h, part_key)

        monkeypatch.setattr(meter, "_forget", stall)

    stalling(one, "one")
    with pytest.raises(Killed):
        await one.flush_once(time.time())
    await _count(redis, expected, hour, tenants[0], "appends", 1)
    stalling(two, "two", unless=stalled["one"])
    with pytest.raises(Killed):
        await two.flush_once(time.time())
    assert stalled["two"] != stalled["one"]
    await forget(one, hour, stalled["one"])  # worker 1 goes on
    assert (await redis.hget(keys.METER_FLUSHING, str(hour))).decode() == stalled["two"]
    assert await redis.exists(stalled["two"])

    await Meter(redis, Archive(str(archive_dir))).flush_once(time.time())
    totals, files = _usage(archive_dir)
    assert _mine(totals, set(tenants)) == expected
    assert set(_of(files, hours)) == {usage_file(hour, part_of(stalled[w])) for w in ("one", "two")}
    assert await _leftovers(redis, set(hours)) == []
    # A worker that read the hour's entry before it went finishes that part now: the part is
    # gone, and no empty file replaces the one written from it.
    assert await Meter(redis, Archive(str(archive_dir)))._finish(hour, stalled["one"]) == 0
    assert _mine(_usage(archive_dir)[0], set(tenants)) == expected


async def test_two_flushers_at_once_write_each_count_once(redis, tmp_path) -> None:
    # (recent hours: after its first round, a flusher finds them by name)
    tenants, expected = [_name(), _name()], Counter()
    hours = [keys.meter_hour(time.time()) - i * 3600 for i in range(3, 9)]
    await _fill(redis, hours, tenants, expected)
    archive_dir = tmp_path / "archive"
    flushers = [Meter(redis, Archive(str(archive_dir))) for _ in range(3)]
    stop = asyncio.Event()

    async def late() -> None:  # counts arriving for the hours being flushed
        rng = random.Random(3)
        while not stop.is_set():
            await _count(
                redis, expected, rng.choice(hours), rng.choice(tenants), "bytes_out", rng.randrange(9)
            )
            await asyncio.sleep(0)

    writer = asyncio.create_task(late())
    for _ in range(6):
        await asyncio.gather(*(f.flush_once(time.time()) for f in flushers))
    stop.set()
    await writer
    await flushers[0].flush_once(time.time())
    assert _mine(_usage(archive_dir)[0], set(tenants)) == _mine(expected, set(tenants))
    assert await _leftovers(redis, set(hours)) == []


async def test_an_old_hour_a_scan_found_and_could_not_move_is_looked_up_by_name(
    redis, tmp_path, monkeypatch
) -> None:
    """An hour older than the lookback that a scan found and could not move (Redis or the
    archive away) is looked up by name in the next rounds, not only at the next scan: moved
    there, and ds_meter_behind_seconds says how long it waited."""
    tenants, expected = [_name()], Counter()
    (old,) = _old_hours(1)
    await _fill(redis, [old], tenants, expected)
    meter = Meter(redis, Archive(str(tmp_path / "archive")))
    take = meter._take

    async def failing(hour: int) -> tuple[str | None, bool]:
        if hour == old:
            raise OSError("Redis is away")
        return await take(hour)

    monkeypatch.setattr(meter, "_take", failing)
    with pytest.raises(OSError):
        await meter.flush_once(time.time())  # the scan round: found, not moved
    monkeypatch.setattr(meter, "_take", take)
    await meter.flush_once(time.time())  # by name: found and moved
    waited = time.time() - (old + 3600 + GRACE_SECONDS)
    assert abs(metrics.METER_BEHIND._value.get() - waited) < 60
    assert await _leftovers(redis, {old}) == []
    assert _mine(_usage(tmp_path / "archive")[0], set(tenants)) == _mine(expected, set(tenants))


async def test_recent_hours_are_found_by_name_and_old_ones_by_a_rare_scan(redis, tmp_path) -> None:
    """A round looks the last LOOKBACK_HOURS up by name; a worker's first round, and one in
    FULL_SCAN_ROUNDS, scans every key: an hour older than that is moved then."""
    tenants, expected = [_name()], Counter()
    recent, old = keys.meter_hour(time.time()) - 5 * 3600, _old_hours(1)[0]
    meter = Meter(redis, Archive(str(tmp_path / "archive")))
    await _fill(redis, [recent, old], tenants, expected)
    await meter.flush_once(time.time())  # the first round: a scan
    assert await _leftovers(redis, {recent, old}) == []
    await meter.flush_once(time.time())  # by name: the old hour the scan found is gone, forgotten
    await _fill(redis, [recent, old], tenants, expected)
    for _ in range(FULL_SCAN_ROUNDS - 2):
        await meter.flush_once(time.time())  # by name: the old hour waits
    assert await redis.exists(keys.meter(old)) and not await redis.exists(keys.meter(recent))
    await meter.flush_once(time.time())  # a scan again
    assert await _leftovers(redis, {recent, old}) == []
    assert metrics.METER_BEHIND._value.get() > 0  # (the old hour, seen at the round's start)
    assert _mine(_usage(tmp_path / "archive")[0], set(tenants)) == _mine(expected, set(tenants))


# -- real worker processes, SIGKILLed -----------------------------------------------


def _worker(redis_url: str, archive_dir: Path) -> subprocess.Popen[bytes]:
    return ready_worker([sys.executable, "-m", "gateway", "archive", "--redis-url", redis_url,
                         "--archive-url", str(archive_dir), "--tenants", "--log-level", "error"])  # fmt: skip


async def test_archive_workers_killed_mid_flush_lose_and_double_nothing(
    own_redis, tmp_path, monkeypatch
) -> None:
    """Worker processes (two at a time) SIGKILLed while a part is being flushed, or at a
    random moment, while late counts keep coming for the hours they flush; then one
    finishes: every count in Parquet once."""
    monkeypatch.setenv("DURABLE_STREAMS_METER_INTERVAL_SECONDS", "0.05")
    redis = aioredis.Redis.from_url(own_redis.url)
    archive_dir = tmp_path / "archive"
    tenants, expected = [_name(), _name()], Counter()
    hours = [keys.meter_hour(time.time()) - i * 3600 for i in range(3, 9)]
    try:
        await redis.set(keys.LAYOUT, layout.CURRENT)  # (as a gateway's first start would)
        await _fill(redis, hours, tenants, expected)
        stop = asyncio.Event()

        async def late() -> None:
            rng = random.Random(5)
            while not stop.is_set():
                await _count(
                    redis, expected, rng.choice(hours), rng.choice(tenants), "bytes_out", rng.randrange(1, 9)
                )
                await asyncio.sleep(0.003)

        writer = asyncio.create_task(late())
        caught = 0  # kills that left a part taken and not finished
        for round_ in range(10):
            workers = await asyncio.gather(
                *(asyncio.to_thread(_worker, own_redis.url, archive_dir) for _ in range(2))
            )
            if round_ % 2 == 0:  # both, the moment one has taken a part
                deadline = time.monotonic() + 3
                while time.monotonic() < deadline and not await redis.hlen(keys.METER_FLUSHING):
                    await asyncio.sleep(0)
                for w in workers:
                    w.kill()
            else:  # each at a random moment
                for w in workers:
                    await asyncio.sleep(random.uniform(0, 0.3))
                    w.kill()
            for w in workers:
                w.wait(10)
            caught += bool(await redis.hlen(keys.METER_FLUSHING))
            if round_ >= 3 and caught >= 2:
                break
        stop.set()
        await writer
        assert caught, "no kill landed between a take and its finish"

        last = _worker(own_redis.url, archive_dir)
        try:
            deadline = time.monotonic() + 20
            while await _leftovers(redis, set(hours)):
                assert time.monotonic() < deadline, await _leftovers(redis, set(hours))
                await asyncio.sleep(0.05)
        finally:
            assert stop_gracefully(last) == 0
        totals, files = _usage(archive_dir)
        assert _mine(totals, set(tenants)) == expected
        assert len({Path(f).name for f in files}) == len(files)  # one file a part
    finally:
        await redis.aclose()


# -- the bill ---------------------------------------------------------------------------


def _at(day: str, hour: int) -> int:
    return int(datetime.fromisoformat(f"{day}T{hour:02d}:00:00").replace(tzinfo=UTC).timestamp())


def _usage_files(archive_dir: Path) -> dict[tuple[str, date], dict[str, int]]:
    """Usage files over three days (day edges, several parts an hour, a counter no code
    knows); what the bill of every day must say."""
    archive = Archive(str(archive_dir))
    parts = [
        (_at("2026-03-01", 23), {"acme appends": 3, "acme bytes_in": 300, "beta appends": 1}),
        (_at("2026-03-01", 23), {"acme appends": 2, "acme gpu_seconds": 7}),  # a late part
        (_at("2026-03-02", 0), {"acme appends": 10, "beta streams_created": 2}),
        (_at("2026-03-02", 13), {"beta bytes_in": 5, "beta appends": 1}),
        (_at("2026-03-03", 0), {"acme streams_deleted": 1}),
    ]
    expected: dict[tuple[str, date], dict[str, int]] = {}
    for hour, fields in parts:
        table = usage_table(hour, {k: str(v) for k, v in fields.items()})
        sink = io.BytesIO()
        pq.write_table(table, sink)
        archive.put(usage_file(hour, uuid.uuid4().hex), sink.getvalue())
        day = datetime.fromtimestamp(hour, UTC).date()
        for field, value in fields.items():
            tenant, counter = field.split(" ")
            row = expected.setdefault((tenant, day), {})
            row[counter] = row.get(counter, 0) + value
    archive.put(f"{USAGE_DIR}/hour=2026-03-02T13/.half-written.parquet.tmp", b"PAR1")  # a crash's
    return expected


def _as_dicts(table) -> dict[tuple[str, date], dict[str, int]]:
    counters = table.column_names[2:]
    return {(r["tenant"], r["day"]): {c: r[c] for c in counters} for r in table.to_pylist()}


def _filled(expected: dict[tuple[str, date], dict[str, int]], days: set[date] | None = None) -> dict:
    chosen = {k: v for k, v in expected.items() if days is None or k[1] in days}
    counters = sorted({c for row in chosen.values() for c in row})
    return {k: {c: v.get(c, 0) for c in counters} for k, v in chosen.items()}


def test_the_bill_sums_per_tenant_and_utc_day(tmp_path) -> None:
    expected = _usage_files(tmp_path / "archive")
    bill = usage_bill.local_bill(str(tmp_path / "archive"))
    assert bill.column_names == ["tenant", "day", "appends", "bytes_in", "gpu_seconds", "streams_created",
                                 "streams_deleted"]  # fmt: skip
    assert [(r["tenant"], r["day"]) for r in bill.to_pylist()] == sorted(expected)
    assert _as_dicts(bill) == _filled(expected)
    assert _as_dicts(bill)[("acme", date(2026, 3, 1))]["appends"] == 5  # two parts of one hour
    one = usage_bill.local_bill(str(tmp_path / "archive"), date(2026, 3, 2), date(2026, 3, 2))
    assert _as_dicts(one) == _filled(expected, {date(2026, 3, 2)})
    assert usage_bill.local_bill(str(tmp_path / "nothing")).num_rows == 0

    out = tmp_path / "bill"
    assert usage_bill.main(["--local", "--archive", str(tmp_path / "archive"), "--out", str(out),
                            "--format", "both", "--from", "2026-03-02"]) == 0  # fmt: skip
    days = {date(2026, 3, 2), date(2026, 3, 3)}
    assert _as_dicts(pq.read_table(out / "parquet" / "bill.parquet")) == _filled(expected, days)
    assert (out / "csv" / "bill.csv").read_text().splitlines()[0].startswith('"tenant","day",')


JAVA = shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


def test_the_spark_job_bills_the_same(tmp_path) -> None:
    pytest.importorskip("pyspark", reason="pyspark is in the [test] extra")
    if not JAVA:
        pytest.skip("Spark needs Java (17+)")
    expected = _usage_files(tmp_path / "archive")
    out = tmp_path / "bill"
    job = subprocess.run(
        [sys.executable, "-m", "workers.usage_bill", "--archive", str(tmp_path / "archive"),
         "--out", str(out), "--format", "both", "--to", "2026-03-02"],
        env={**os.environ, "PYSPARK_PYTHON": sys.executable}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    spark_bill = pq.read_table(out / "parquet")
    assert _as_dicts(spark_bill) == _filled(expected, {date(2026, 3, 1), date(2026, 3, 2)})
    local = usage_bill.local_bill(str(tmp_path / "archive"), None, date(2026, 3, 2))
    assert spark_bill.column_names == local.column_names
    assert sorted(spark_bill.to_pylist(), key=lambda r: (r["tenant"], r["day"])) == local.to_pylist()
    assert list((out / "csv").glob("*.csv"))
