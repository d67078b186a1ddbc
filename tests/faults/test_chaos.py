"""Faults under load: crash and freeze Redis, gateways and archive workers while
writers append and live readers tail, then check the whole history.

Cluster: one redis-server (AOF, ``appendfsync always``), two gateways, two
archive workers archiving everything at once (reads fall through to Parquet),
all real processes on 127.0.0.1. Workload: per stream, plain writers and
idempotent producers appending through either gateway, an SSE and a long-poll
reader from the start (and late readers joining mid-run), see ``workload.py``.

Faults, at seeded random moments, one at a time:

* ``redis_kill``: SIGKILL Redis, restart it on the same directory and port;
* ``redis_pause``: SIGSTOP Redis for a few seconds, then SIGCONT;
* ``gateway_kill``: SIGKILL a gateway, restart it on its port;
* ``archiver_kill``: SIGKILL an archive worker, restart it;
* ``archiver_pause``: SIGSTOP an archive worker past its lease (another takes
  over its streams), then SIGCONT it: its late writes must be fenced;
* ``archiver_pause_mid_write``: the same, but the worker is stopped the moment
  it is seen (``/proc/<pid>/task/*/syscall``) syncing or renaming a file, i.e.
  between staging a range and committing it;
* ``redis_restart_new_readers``: SIGKILL Redis and restart it while readers of
  brand-new streams (SSE and long-poll) keep arriving at both gateways; once it
  is back, one append per stream must reach every one of them within
  ``PROBE_BOUND`` seconds (well under the long-poll timeout and SSE cycle, so a
  reader whose subscription was lost in the restart shows up as late);
* ``gateway_restart_new_readers``: the same around a gateway's SIGKILL and
  restart: the readers are the new process's first.

Beyond the history checks, every record acknowledged while a reader was
tailing must reach it within ``LAG_BOUND`` seconds (``history.check_delivery``).

Then writers stop, every stream is closed, readers must see the close, and the
checker (``history.py``) judges every stream against a final catch-up read
from the start (through each gateway: both must agree).

Modes: CI (default) runs about 75 s. Soak (``DS_FAULT_SOAK=1``) runs
``DS_FAULT_SOAK_SECONDS`` (default 1800) with more streams, writers, readers
and faults. ``DS_FAULT_SEED`` replays a schedule.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from gateway.cli.embedded import find_redis_server

from . import harness
from .conftest import Summary
from .history import Append, ReaderLog, Tally, check_delivery, check_stream, record
from .workload import (
    PREFIX,
    READERS,
    TEXT,
    Clock,
    Stats,
    Timing,
    post_record,
    read_all,
    until_2xx,
    writer,
)

PROBE_BOUND = 6.0  # seconds from an acked append to a freshly (re)connected reader
PROBE_STREAMS = 8  # new streams per probe
LAG_BOUND = 10.0  # seconds from any ack to every live reader (well under the long-poll timeout)
CLOSE_BOUND = 50.0  # seconds for every reader to see the close (> SSE cycle, long-poll timeout)
LEASE_SECONDS = 2.0


@dataclass(frozen=True)
class Plan:
    duration: float  # seconds of load
    cool_down: float  # no fault starts in the last seconds of the load
    streams: int
    plain_writers: int  # per stream
    producers: int  # per stream
    sse_readers: int  # per stream, from the start
    long_poll_readers: int
    late_readers: int  # per stream and wave, joining mid-run from the start
    late_waves: int  # how many times late readers join
    bulk_writers: int  # per stream: idempotent producers of bulk records, every second or so
    bulk_bytes: int  # padding of a bulk record: not carried in pub/sub notices, slower to archive
    pace: float  # a writer waits up to this long between appends
    max_ops: int  # per writer
    fault_gap: tuple[float, float]  # seconds between faults


CI = Plan(duration=60, cool_down=8, streams=4, plain_writers=2, producers=1, sse_readers=1,
          long_poll_readers=1, late_readers=1, late_waves=1, bulk_writers=1, bulk_bytes=64 * 1024,
          pace=0.04, max_ops=20_000, fault_gap=(1.0, 3.0))  # fmt: skip
# Soak: about 800k appends over 30 minutes, a few hundred faults; memory stays around 1 GB
# (readers' bytes are kept compressed, see history.Received).
SOAK = Plan(duration=float(os.environ.get("DS_FAULT_SOAK_SECONDS", "1800")), cool_down=20, streams=12,
            plain_writers=3, producers=2, sse_readers=2, long_poll_readers=2, late_readers=2, late_waves=6,
            bulk_writers=1, bulk_bytes=8 * 1024, pace=0.15, max_ops=10**7,
            fault_gap=(2.0, 15.0))  # fmt: skip
TIMING = Timing(long_poll_timeout=30.0)
# Long waits, so that a reader that slept through an append stands out (LAG_BOUND, PROBE_BOUND).
GATEWAY_FLAGS = ["--long-poll-timeout", "30", "--sse-cycle-seconds", "40", "--sse-heartbeat-seconds", "1",
                 "--max-body-bytes", str(1 << 20)]  # fmt: skip


@dataclass
class Run:
    cluster: harness.Cluster
    session: aiohttp.ClientSession
    rng: random.Random
    seed: int
    clock: Clock = field(default_factory=Clock)
    stats: Stats = field(default_factory=Stats)
    fault_log: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    appends: dict[str, list[Append]] = field(default_factory=dict)
    readers: dict[str, list[ReaderLog]] = field(default_factory=dict)
    probes: int = 0

    def gateways(self) -> list[str]:
        return [gw.base for gw in self.cluster.live_gateways()]

    def log(self, text: str) -> None:
        self.fault_log.append(f"t={self.clock():6.2f}s {text}")


# -- faults ------------------------------------------------------------------


async def redis_kill(run: Run) -> str:
    run.cluster.redis.kill()
    down = run.rng.uniform(0.3, 2.0)
    await asyncio.sleep(down)
    await asyncio.to_thread(run.cluster.redis.start)
    return f"Redis SIGKILLed, restarted after {down:.1f}s"


async def redis_pause(run: Run) -> str:
    run.cluster.redis.pause()
    frozen = run.rng.uniform(1.5, 4.0)
    await asyncio.sleep(frozen)
    run.cluster.redis.resume()
    return f"Redis SIGSTOPped for {frozen:.1f}s"


async def gateway_kill(run: Run) -> str:
    gw = run.rng.choice(run.cluster.gateways)
    gw.kill()
    down = run.rng.uniform(0.2, 1.5)
    await asyncio.sleep(down)
    await asyncio.to_thread(gw.start_ready)
    return f"{gw.name} SIGKILLed, restarted after {down:.1f}s"


async def archiver_kill(run: Run) -> str:
    worker = run.rng.choice(run.cluster.archivers)
    worker.kill()
    down = run.rng.uniform(0.1, 1.0)
    await asyncio.sleep(down)
    worker.start()
    return f"{worker.name} SIGKILLed, restarted after {down:.1f}s"


async def archiver_pause(run: Run) -> str:
    worker = run.rng.choice(run.cluster.archivers)
    worker.pause()
    frozen = LEASE_SECONDS + run.rng.uniform(0.5, 2.5)
    await asyncio.sleep(frozen)
    worker.resume()
    return f"{worker.name} SIGSTOPped for {frozen:.1f}s (lease {LEASE_SECONDS}s)"


async def archiver_pause_mid_write(run: Run) -> str:
    """Stop a worker while it writes an archive file (staged, not yet committed), past its
    lease: another worker redoes the range; the stopped one, continued, must change nothing."""
    worker = run.rng.choice(run.cluster.archivers)
    caught = await asyncio.to_thread(worker.pause_mid_write, 5.0)
    if not caught:
        worker.pause()
    frozen = LEASE_SECONDS + run.rng.uniform(1.0, 4.0)  # its successor redoes, commits, merges
    await asyncio.sleep(frozen)
    worker.resume()
    where = "caught writing a file" if caught else "not caught writing within 5s; stopped anyway"
    return f"{worker.name} SIGSTOPped for {frozen:.1f}s (lease {LEASE_SECONDS}s), {where}"


async def _probe(
    run: Run, what: str, outage: Callable[[], Awaitable[str]], window: float, at: list[harness.GatewayProc]
) -> str:
    """Readers of brand-new streams (no subscription anywhere yet) arrive at the gateways
    ``at`` during ``window`` seconds from the start of ``outage``; once it is over, one
    append to each stream must reach every one of them within PROBE_BOUND seconds."""
    run.probes += 1
    n = run.probes
    streams = [f"probe{n}-{k}" for k in range(PROBE_STREAMS)]
    for stream in streams:
        await until_2xx(
            lambda stream=stream: run.session.put(
                f"{run.rng.choice(run.gateways())}{PREFIX}{stream}", headers=TEXT
            ),
            f"create {stream}",
        )
        run.appends[stream] = []
        run.readers[stream] = []
    logs: list[ReaderLog] = []
    tasks: list[asyncio.Task[None]] = []
    deadline = time.monotonic() + window + 90
    for stream in streams:
        for gw in at:
            for mode in ("sse", "long-poll"):
                log = ReaderLog(stream, f"{stream}-{mode}-{gw.name}", mode)
                logs.append(log)

                async def arrive(log: ReaderLog = log, base: str = gw.base, mode: str = mode) -> None:
                    await asyncio.sleep(run.rng.uniform(0, window))
                    await READERS[mode](
                        run.session, lambda: [base], log, rng=random.Random(run.rng.random()),
                        deadline=deadline, timing=TIMING, stats=run.stats,
                    )  # fmt: skip

                tasks.append(asyncio.create_task(arrive()))
    detail = await outage()
    await asyncio.sleep(0.5)
    acks: dict[str, float] = {}
    for stream in streams:
        marker = Append(stream, "probe", n)
        run.appends[stream].append(marker)
        for _ in range(50):
            attempt = await post_record(
                run.session, run.rng.choice(run.gateways()), marker, TIMING, run.clock, run.stats
            )
            if attempt.kind == "acked":
                acks[stream] = time.monotonic()
                break
            await asyncio.sleep(0.2)
        else:
            run.violations.append(
                f"probe {n}: the append to {stream!r} was never acknowledged: {marker.describe()}"
            )
    wanted = record("probe", n)

    def arrival(log: ReaderLog) -> float | None:
        return next((t for t, size in log.arrivals if size >= len(wanted)), None)

    give_up = time.monotonic() + PROBE_BOUND + 5  # a little past the bound, to say how late
    while time.monotonic() < give_up and any(arrival(log) is None for log in logs if log.stream in acks):
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for log in logs:
        if log.stream not in acks:
            continue
        arrived, acked = arrival(log), acks[log.stream]
        got = bytes(log.received)
        if arrived is None or arrived - acked > PROBE_BOUND:
            late = f"{arrived - acked:.1f}s after" if arrived else f"not within {give_up - acked:.0f}s of"
            acked_t = run.clock() - (time.monotonic() - acked)
            run.violations.append(
                f"probe {n} ({what}): {log.mode} reader {log.name!r} of a new stream, arriving during the "
                f"outage, got the stream's first append {late} its ack at t={acked_t:.1f}s "
                f"(bound {PROBE_BOUND:.0f}s): a live reader slept through an append; its requests: "
                f"{len(log.connects)}, answers {dict(log.statuses)}, errors {dict(log.errors)}"
            )
        elif got != wanted:
            run.violations.append(
                f"probe {n}: {log.mode} reader {log.name!r} got {got[:80]!r}, expected {wanted!r}"
            )
    return f"{detail}; {len(logs)} readers of {len(streams)} new streams arrived meanwhile (probe {n})"


async def redis_restart_new_readers(run: Run) -> str:
    """Redis is SIGKILLed and restarted while readers of new streams arrive at both gateways."""
    down = run.rng.uniform(0.5, 2.0)

    async def outage() -> str:
        run.cluster.redis.kill()
        await asyncio.sleep(down)
        await asyncio.to_thread(run.cluster.redis.start)
        for gw in run.cluster.gateways:
            await asyncio.to_thread(gw.wait_ready, 15)
        return f"Redis SIGKILLed, restarted after {down:.1f}s"

    # Readers keep arriving for a while after the restart: the gateways' pub/sub connections
    # come back on their own schedule (a backoff), and first readers must not race them.
    return await _probe(run, "Redis restart", outage, down + 4.0, run.cluster.gateways)


async def gateway_restart_new_readers(run: Run) -> str:
    """A gateway is SIGKILLed and restarted while readers of new streams arrive at it: they
    are its first readers, racing its pub/sub connection as it opens."""
    gw = run.rng.choice(run.cluster.gateways)
    down = run.rng.uniform(0.2, 1.0)

    async def outage() -> str:
        gw.kill()
        await asyncio.sleep(down)
        await asyncio.to_thread(gw.start_ready)
        return f"{gw.name} SIGKILLed, restarted after {down:.1f}s"

    return await _probe(run, f"{gw.name} restart", outage, down + 2.0, [gw])


FAULTS: dict[str, Callable[[Run], Awaitable[str]]] = {
    "redis_kill": redis_kill,
    "redis_pause": redis_pause,
    "gateway_kill": gateway_kill,
    "archiver_kill": archiver_kill,
    "archiver_pause": archiver_pause,
    "archiver_pause_mid_write": archiver_pause_mid_write,
    "redis_restart_new_readers": redis_restart_new_readers,
    "gateway_restart_new_readers": gateway_restart_new_readers,
}


EXTRA_WEIGHT = {
    "archiver_pause_mid_write": 3,
    "redis_restart_new_readers": 2,
    "gateway_restart_new_readers": 2,
}


async def inject_faults(run: Run, plan: Plan, until: float) -> None:
    """Every kind once (in a seeded order), then seeded random kinds (the ones that find
    races, more often: EXTRA_WEIGHT), until ``until`` (run clock)."""
    kinds = list(FAULTS)
    run.rng.shuffle(kinds)
    names = list(FAULTS)
    weights = [EXTRA_WEIGHT.get(name, 1) for name in names]
    while True:
        await asyncio.sleep(run.rng.uniform(*plan.fault_gap))
        if run.clock() >= until:
            return
        kind = kinds.pop(0) if kinds else run.rng.choices(names, weights)[0]
        run.log(f"{kind} ...")
        detail = await FAULTS[kind](run)
        run.faults[kind] += 1
        run.log(f"{kind}: {detail}")


# -- the run -----------------------------------------------------------------


def _tally(summary: Summary, run: Run, contents: dict[str, bytes]) -> Tally:
    tally = Tally()
    for stream, appends in run.appends.items():
        tally.add(contents.get(stream, b""), appends)
    summary.operations += tally.operations
    summary.attempts += tally.attempts
    summary.acknowledged += tally.acknowledged
    summary.unknown += tally.unknown
    summary.failed += tally.failed
    summary.lost += tally.lost
    summary.duplicated += tally.duplicated
    summary.reads += sum(r.connections for logs in run.readers.values() for r in logs)
    summary.faults.update(run.faults)
    return tally


KINDS = ["LOST", "DUPLICATED", "DUPLICATE", "GAP", "out of order", "4xx is present", "never sent",
         "no writer sent", "ends inside a record", "slept through", "did not see the close",
         "catch-up reads disagree", "catch-up read", "answered", "break the protocol", "crashed",
         "archived nothing", "saw the stream close", "diverges"]  # fmt: skip


def _kind(violation: str) -> str:
    return next((k for k in KINDS if k in violation), "other")


async def test_faults_under_load(tmp_path: Path, fault_seed: int, soak: bool, summary: Summary) -> None:
    try:
        find_redis_server()
    except RuntimeError:
        pytest.skip("needs a redis-server binary to kill and restart")
    plan = SOAK if soak else CI
    rng = random.Random(f"{fault_seed}:chaos")
    print(f"\nfault run: seed {fault_seed}, plan {plan}")
    with harness.cluster(tmp_path, gateways=2, archivers=2, gateway_flags=GATEWAY_FLAGS,
                         lease_seconds=LEASE_SECONDS) as cluster:  # fmt: skip
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            run = Run(cluster, session, rng, fault_seed)
            try:
                contents = await _run(run, plan)
            finally:
                print("\n".join(run.fault_log))
        tally = _tally(summary, run, contents)
        summary.violations += len(run.violations)
        if run.violations:
            kinds = Counter(_kind(v) for v in run.violations)
            shown = run.violations[:60]
            more = len(run.violations) - len(shown)
            pytest.fail(
                f"{len(run.violations)} violations (seed {fault_seed}; "
                f"replay with DS_FAULT_SEED={fault_seed}); "
                f"{tally.operations} appends, {tally.acknowledged} acked, {tally.unknown} unknown, "
                f"lost {tally.lost}, duplicated {tally.duplicated}; by kind: {dict(kinds)}:\n  "
                + "\n  ".join(shown)
                + (f"\n  ... and {more} more" if more else "")
                + "\nfaults:\n  "
                + "\n  ".join(run.fault_log)
                + f"\nanswers: {dict(run.stats.statuses)}\nlogs in {cluster.logs}",
                pytrace=False,
            )


async def _run(run: Run, plan: Plan) -> dict[str, bytes]:
    session, rng = run.session, run.rng
    streams = [f"chaos-{i}" for i in range(plan.streams)]
    base0 = run.cluster.gateways[0].base
    for stream in streams:
        async with session.put(f"{base0}{PREFIX}{stream}", headers=TEXT) as r:
            assert r.status == 201, f"create {stream}: {r.status} {await r.text()}"
        run.appends[stream] = []
        run.readers[stream] = []

    stop = asyncio.Event()
    reader_deadline = time.monotonic() + plan.duration + 120
    reader_tasks: list[asyncio.Task[None]] = []

    def start_reader(stream: str, mode: str, name: str) -> None:
        log = ReaderLog(stream, name, mode)
        run.readers[stream].append(log)
        reader_tasks.append(asyncio.create_task(READERS[mode](
            session, run.gateways, log, rng=random.Random(rng.random()), deadline=reader_deadline,
            timing=TIMING, stats=run.stats,
        )))  # fmt: skip

    for stream in streams:
        for i in range(plan.sse_readers):
            start_reader(stream, "sse", f"{stream}-sse{i}")
        for i in range(plan.long_poll_readers):
            start_reader(stream, "long-poll", f"{stream}-lp{i}")
    writer_tasks = []
    for s, stream in enumerate(streams):
        for w in range(plan.plain_writers + plan.producers + plan.bulk_writers):
            producer = w >= plan.plain_writers
            bulk = w >= plan.plain_writers + plan.producers
            name = f"s{s}{'b' if bulk else 'p' if producer else 'w'}{w}"
            writer_tasks.append(asyncio.create_task(writer(
                session, run.gateways, stream, name, run.appends[stream], producer=producer,
                rng=random.Random(rng.random()), stop=stop, timing=TIMING, clock=run.clock, stats=run.stats,
                max_ops=plan.max_ops, pad=plan.bulk_bytes if bulk else 0, pace=2.0 if bulk else plan.pace,
            )))  # fmt: skip

    async def late_readers() -> None:
        waves = sorted(rng.uniform(0.2, 0.8) * plan.duration for _ in range(plan.late_waves))
        for wave, at in enumerate(waves):
            await asyncio.sleep(max(0.0, at - run.clock()))
            run.log(f"late readers (wave {wave}) join from the start")
            for stream in streams:
                for i in range(plan.late_readers):
                    start_reader(stream, rng.choice(["sse", "long-poll"]), f"{stream}-late{wave}.{i}")

    late = asyncio.create_task(late_readers())
    faults = asyncio.create_task(inject_faults(run, plan, plan.duration - plan.cool_down))
    try:
        await asyncio.sleep(plan.duration)
        await faults  # the last fault finishes (restarts what it stopped)
        await late
    finally:
        stop.set()
        if not faults.done():
            faults.cancel()
    run.log("writers stop")
    await asyncio.wait_for(asyncio.gather(*writer_tasks), TIMING.producer_give_up + 30)
    for gw in run.cluster.gateways:  # everything up for the end
        if not gw.running:
            await asyncio.to_thread(gw.start_ready)
    run.cluster.redis.resume()
    for worker in run.cluster.archivers:
        worker.resume()

    run.log("streams close")
    for stream in run.appends:
        await until_2xx(
            lambda stream=stream: session.post(
                f"{rng.choice(run.gateways())}{PREFIX}{stream}", headers={"Stream-Closed": "true"}
            ),  # fmt: skip
            f"close {stream}",
        )
    closed_at = time.monotonic()
    pending = [t for t in reader_tasks if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=CLOSE_BOUND)
    for task in reader_tasks:
        task.cancel()
    outcomes = await asyncio.gather(*reader_tasks, return_exceptions=True)
    run.log(f"readers done ({time.monotonic() - closed_at:.1f}s after the close)")
    for outcome in outcomes:
        if isinstance(outcome, Exception):  # not a cancellation: the reader itself broke
            run.violations.append(f"a reader crashed: {outcome!r}")

    archived = list(run.cluster.archive_dir.rglob("*.parquet"))
    run.log(f"archive: {len(archived)} Parquet files, {sum(f.stat().st_size for f in archived):,} bytes")
    if not archived:
        run.violations.append(
            f"the archive workers archived nothing in {plan.duration:.0f}s with a hot window of 0 "
            f"(no Parquet files in {run.cluster.archive_dir}): reads never fell through to the archive"
        )
    contents: dict[str, bytes] = {}
    acks = {a.record: run.clock.started + a.acked_at for v in run.appends.values() for a in v if a.acked_at}
    for stream in run.appends:
        try:
            versions = {gw.name: await read_all(session, gw.base, stream) for gw in run.cluster.gateways}
        except AssertionError as exc:  # unreadable: nothing else about this stream can be checked
            acked = sum(a.outcome == "acked" for a in run.appends[stream])
            run.violations.append(
                f"stream {stream!r}: the final catch-up read from the start failed ({acked} acknowledged "
                f"appends unreadable): {exc}"
            )
            for log in run.readers.get(stream, []):
                run.violations.append(
                    f"stream {stream!r}: {log.mode} reader {log.name!r} received {len(log.received)} bytes, "
                    f"finished: {log.finished}, answers {dict(log.statuses)}, errors {dict(log.errors)}"
                )
            continue
        content = versions[run.cluster.gateways[0].name]
        for name, other in versions.items():
            if other != content:
                run.violations.append(
                    f"stream {stream!r}: catch-up reads disagree: {run.cluster.gateways[0].name} has "
                    f"{len(content)} bytes, {name} has {len(other)}"
                )
        contents[stream] = content
        readers = run.readers.get(stream, [])
        run.violations += check_stream(
            stream, content, run.appends[stream], readers, context=f"seed {run.seed}"
        )
        for log in readers:
            run.violations += check_delivery(stream, log, acks, LAG_BOUND)
            if not log.finished:
                run.violations.append(
                    f"stream {stream!r}: {log.mode} reader {log.name!r} did not see the close within "
                    f"{CLOSE_BOUND}s (received {len(log.received)} of {len(content)} bytes, "
                    f"{log.connections} connections, answers {dict(log.statuses)}, errors {dict(log.errors)})"
                )
    return contents
