"""Subscriptions (protocol sections 6-7): what many pattern subscriptions cost appends,
and webhook delivery, ours against the reference server.

    python -m loadtest.subscriptions [--seconds 4] [--rounds 3] [--subscriptions 10000]
    python -m loadtest.compare --subscriptions [the same options]

1. **Appends beside many pattern subscriptions.** Four servers start and stay up:
   ours (one gateway on its embedded Redis, AOF fsync always, and a
   ``durable-streams deliver`` worker beside it) with no subscriptions and with
   ``--subscriptions`` webhook subscriptions whose patterns match none of the
   benchmark's streams (``tenant-<i>/*``, ``other/<i>/**``); and the reference
   server likewise (``--reference-kind``: file-backed by default). The
   subscriptions are registered concurrently (``--register-concurrency`` PUTs in
   flight) before any round; for ours the time until its worker has linked every
   pattern's existing streams (the backfill, spec 6.2) is reported too. Then the
   append scenarios of ``loadtest/appends.py`` (wrk) run interleaved: for each
   round and scenario every server in turn, the order rotated each time. The
   reference matches every append against every subscription's pattern, in the
   event loop that serves requests: its runs are as long as anyone's (wrk's
   ``-d``), whatever it manages in them.
2. **Webhooks.** Ours (gateway + deliver worker) and the reference, fresh, side by
   side: ``--streams`` streams, each with one webhook subscription (or one pattern
   subscription over all of them: ``--webhook-subscriptions pattern``) whose URL
   is a receiver in this process (aiohttp) that answers ``{"done": true}`` at once
   (so the server auto-acks the wake) and notes when each webhook arrived.
   Writers append 100 B for ``--seconds``: ``paced`` at ``--rate`` appends/s in
   all, spread evenly over the streams, and ``max``, one writer per stream back
   to back. A webhook covers an append when it names the append's stream with a
   ``tail_offset`` at or past the append's ``Stream-Next-Offset``; each append's
   latency runs from its 2xx response to the arrival of the first webhook that
   covers it. One webhook may cover many appends (a wake snapshots whatever is
   pending; appends meanwhile wait for the next wake): webhooks/s and appends per
   webhook are both reported. Servers alternate, the order rotated each round.

Writes ``<out>.json`` (settings, summaries, every run), ``<out>.md`` (the tables)
and, with matplotlib, ``<out>.png``. Everything runs on one (shared, 2-core)
machine, the load generators and the webhook receiver included: medians over
rounds, for comparing, not absolute capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import statistics
import subprocess
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import redis
from aiohttp import web

from gateway.redis_io import keys

from .appends import run_appends, scenario
from .cluster import _machine_busy, cores, machine_busy_percent
from .servers import ProcessMeter, Running, client_headers, free_port, start, use_uvloop, worker

DEFAULT_SCENARIOS = ("64w-1s-100B", "64w-1000s-100B")
ALLOW = ("--webhook-allow", "127.0.0.0/8")
NOWHERE = "http://127.0.0.1:9/never"  # the non-matching subscriptions' webhook: never called
BODY = b"x" * 100


@dataclass
class Server:
    """One server under test, up for the whole part."""

    key: str  # "ours", "ours+subs", "reference", "reference+subs"
    kind: str  # servers.start's
    subscriptions: int
    running: Running
    worker_pid: int | None = None  # ours' deliver worker

    @property
    def ours(self) -> bool:
        return self.kind.startswith("ours")

    @property
    def socket(self) -> Path:
        return Path(self.running.data_dir, "redis.sock")

    def redis(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket))


@contextlib.contextmanager
def serve(key: str, kind: str, args: argparse.Namespace, subscriptions: int = 0) -> Iterator[Server]:
    """A server; ours with ``--webhook-allow 127.0.0.0/8`` and a deliver worker beside it,
    its Redis with no automatic AOF rewrite (none lands inside a run) and fsync stalls logged."""
    if kind.startswith("ours"):
        with start(kind, *ALLOW) as running:
            extra = [*ALLOW]
            if args.worker_redis_url:
                extra += ["--redis-url", f"unix://{running.data_dir}/redis.sock"]
            with worker(running, "deliver", *extra) as proc:
                server = Server(key, kind, subscriptions, running, proc.pid)
                with server.redis() as r:
                    r.config_set("auto-aof-rewrite-percentage", 0)
                    r.config_set("latency-monitor-threshold", 5)
                yield server
        return
    with start(kind) as running:
        yield Server(key, kind, subscriptions, running)


def subscription_url(server: Server, sub: str) -> str:
    return f"{server.running.base_url}/__ds/subscriptions/{sub}"


class Meter:
    """Around one run: CPU seconds of the server's processes (ours: gateway, deliver
    worker, Redis; the reference: its one process), the longest AOF fsync (ours) and how
    busy the machine was (all cores, 200% = both of 2)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.cpu: dict[str, float] = {}
        self.longest_fsync_ms: int | None = None
        self.machine_busy_percent = 0.0
        self.seconds = 0.0  # wall time between enter and exit
        self.redis_calls: dict[str, int] = {}  # ours: commands Redis ran meanwhile (INFO commandstats)
        self.settle_seconds = 0.0  # ours: waiting for the worker to empty its outbox first

    def _redis_cpu(self) -> float:
        with self.server.redis() as r:
            info = r.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def _redis_calls(self) -> dict[str, int]:
        with self.server.redis() as r:
            stats = r.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}

    def settle(self, timeout: float = 30.0) -> None:
        """Ours: until the deliver worker has taken every outbox entry (with pattern
        subscriptions, each new stream is one: matched against the patterns once), so that
        the streams a run has just made are not counted as its appends' cost."""
        began = time.monotonic()
        with self.server.redis() as r:
            while r.zcard(keys.SUBS_OUTBOX) and time.monotonic() - began < timeout:
                time.sleep(0.02)
        self.settle_seconds = round(time.monotonic() - began, 2)

    def __enter__(self) -> Meter:
        if self.server.ours:
            self.settle()
        self._machine = _machine_busy()
        self._started = time.monotonic()
        self._gateway = ProcessMeter(self.server.running.pid)
        self._worker = ProcessMeter(self.server.worker_pid) if self.server.worker_pid else None
        if self.server.ours:
            with self.server.redis() as r:
                r.execute_command("LATENCY", "RESET")
            self._redis0 = self._redis_cpu()
            self._calls0 = self._redis_calls()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, total = (now - then for now, then in zip(_machine_busy(), self._machine, strict=True))
        self.machine_busy_percent = round(100 * cores() * busy / max(1, total), 1)
        self.seconds = time.monotonic() - self._started
        name = "gateway" if self.server.ours else "server"
        self.cpu = {name: round(self._gateway.cpu_used(), 3)}
        if self._worker:
            self.cpu["worker"] = round(self._worker.cpu_used(), 3)
        if self.server.ours:
            self.cpu["redis"] = round(self._redis_cpu() - self._redis0, 3)
            calls = self._redis_calls()
            self.redis_calls = {
                k: v - self._calls0.get(k, 0) for k, v in sorted(calls.items()) if v > self._calls0.get(k, 0)
            }
            with self.server.redis() as r:
                events = {e[0].decode(): int(e[3]) for e in r.execute_command("LATENCY", "LATEST")}
            self.longest_fsync_ms = events.get("aof-fsync-always", 0)


# -- part 1: registering many subscriptions, and appends beside them ------------------------


def non_matching(i: int) -> str:
    """A pattern no benchmark stream matches (theirs are one segment: ``appends-...``)."""
    return f"tenant-{i}/*" if i % 2 == 0 else f"other/{i}/**"


async def register(server: Server, count: int, concurrency: int) -> dict:
    """PUT ``count`` non-matching pattern subscriptions, ``concurrency`` at a time."""
    statuses: Counter[str] = Counter()
    failures: list[dict] = []
    queue = iter(range(count))
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = client_headers(server.kind)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:

        async def one_by_one() -> None:
            for i in queue:
                url = subscription_url(server, f"bench-{i}")
                body = {
                    "type": "webhook",
                    "pattern": non_matching(i),
                    "webhook": {"url": NOWHERE},
                    "lease_ttl_ms": 30000,
                }
                try:
                    async with http.put(url, json=body) as r:
                        text = await r.text()
                        statuses[str(r.status)] += 1
                        if r.status != 201 and len(failures) < 5:
                            failures.append(
                                {
                                    "request": f"PUT {url} {json.dumps(body)}",
                                    "status": r.status,
                                    "body": text[:500],
                                }
                            )
                except aiohttp.ClientError as exc:
                    statuses[type(exc).__name__] += 1

        began = time.monotonic()
        await asyncio.gather(*(one_by_one() for _ in range(concurrency)))
        seconds = time.monotonic() - began
    return {
        "subscriptions": count,
        "concurrency": concurrency,
        "seconds": round(seconds, 2),
        "per_second": round(count / seconds, 1),
        "statuses": dict(statuses),
        "failures": failures,
    }


def await_backfills(server: Server, count: int, began: float, timeout: float) -> dict:
    """Ours: wait until the deliver worker has done every pattern's backfill (the
    subscription's state says ``backfill`` 0) and nothing is due; seconds since ``began``."""
    state_keys = [keys.sub_keys(f"bench-{i}", False)[0] for i in range(count)]
    due = keys.due_keys(False)[0]
    worker = ProcessMeter(server.worker_pid) if server.worker_pid else None
    deadline = time.monotonic() + timeout
    left = count
    with server.redis() as r:
        while time.monotonic() < deadline:
            pipe = r.pipeline(transaction=False)
            for key in state_keys:
                pipe.hget(key, "backfill")
            left = sum(1 for v in pipe.execute() if v != b"0")
            if not left and not r.zcard(due):
                break
            time.sleep(0.25)
    return {
        "backfill_done_seconds": round(time.monotonic() - began, 2) if not left else None,
        "backfills_left": left,
        "worker_cpu_seconds_since_ready": round(worker.cpu_used(), 2) if worker else None,
    }


@dataclass
class AppendRun:
    server: str
    subscriptions: int
    scenario: str
    round: int
    appends_per_second: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]
    cpu_seconds: dict[str, float]
    longest_fsync_ms: int | None
    machine_busy_percent: float
    redis_calls: dict[str, int] = field(default_factory=dict)  # ours: by command (INFO commandstats)
    settle_seconds: float = 0.0  # ours: the new streams matched against the patterns before the run


def append_once(server: Server, name: str, round_: int, seconds: float) -> AppendRun:
    meter = Meter(server)
    r = asyncio.run(
        run_appends(
            server.running.base_url, server.kind, name, seconds, server.running.pid, measure=lambda: meter
        )
    )
    return AppendRun(
        server=server.key,
        subscriptions=server.subscriptions,
        scenario=name,
        round=round_,
        appends_per_second=r.appends_per_second,
        p50_ms=r.p50_ms,
        p99_ms=r.p99_ms,
        errors=r.errors,
        cpu_seconds=meter.cpu,
        longest_fsync_ms=meter.longest_fsync_ms,
        machine_busy_percent=meter.machine_busy_percent,
        redis_calls=meter.redis_calls,
        settle_seconds=meter.settle_seconds,
    )


def part_appends(args: argparse.Namespace, kinds: Sequence[str]) -> dict:
    names = args.scenarios.split(",")
    for name in names:
        scenario(name)  # a KeyError now, not after the start-up
    out: dict = {"registration": {}, "runs": []}
    with contextlib.ExitStack() as stack:
        servers: list[Server] = []
        for kind in kinds:
            base = "ours" if kind.startswith("ours") else "reference"
            servers.append(stack.enter_context(serve(base, kind, args)))
            servers.append(stack.enter_context(serve(f"{base}+subs", kind, args, args.subscriptions)))
        for server in servers:
            if not server.subscriptions:
                continue
            began = time.monotonic()
            reg = asyncio.run(register(server, server.subscriptions, args.register_concurrency))
            if server.ours:
                reg |= await_backfills(server, server.subscriptions, began, args.backfill_timeout)
            out["registration"][server.key] = reg
            print(f"{server.key:<16} registered {reg['subscriptions']:,} pattern subscriptions in "
                  f"{reg['seconds']} s ({reg['per_second']:,}/s, {args.register_concurrency} at a time): "
                  f"{reg['statuses']}"
                  + (f"; backfills done {reg['backfill_done_seconds']} s after the first PUT "
                     f"({reg['backfills_left']} left), worker CPU {reg['worker_cpu_seconds_since_ready']} s"
                     if server.ours else ""), flush=True)  # fmt: skip
            for failure in reg["failures"]:
                print(f"  refused: {failure}", flush=True)
        if args.warmup_seconds:
            for server in servers:
                append_once(server, names[0], -1, args.warmup_seconds)
        for round_ in range(args.rounds):
            for i, name in enumerate(names):
                shift = (round_ + i) % len(servers)
                for server in servers[shift:] + servers[:shift]:
                    run = append_once(server, name, round_, args.seconds)
                    out["runs"].append(run)
                    errors = sum(run.errors.values())
                    print(f"round {round_} {name:<15} {server.key:<16} {run.appends_per_second:>9,.0f}/s "
                          f"p99 {run.p99_ms:>7} ms errors {errors:,} cpu {run.cpu_seconds} "
                          f"fsync≤{run.longest_fsync_ms} ms machine {run.machine_busy_percent:.0f}% "
                          f"settle {run.settle_seconds} s",
                          flush=True)  # fmt: skip
    out["summary"] = summarize_appends(out["runs"], args.seconds)
    out["runs"] = [asdict(r) for r in out["runs"]]
    return out


def summarize_appends(runs: Sequence[AppendRun], seconds: float) -> dict:
    """Per scenario and server: medians over rounds; CPU per 1,000 appends from the sums
    over the rounds (less at the mercy of a shared machine than a rate: it counts work,
    not how much of the machine the server got); the ratios with subscriptions/without."""
    by: dict[str, dict[str, list[AppendRun]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by[run.scenario][run.server].append(run)
    out: dict[str, dict] = {}
    for name, servers in by.items():
        out[name] = {}
        for key, rs in servers.items():
            errors: Counter[str] = Counter()
            for r in rs:
                errors.update(r.errors)
            cpu: Counter[str] = Counter()
            calls: Counter[str] = Counter()
            for r in rs:
                cpu.update(r.cpu_seconds)
                calls.update(r.redis_calls)
            # wrk's rate is over its -d, whole seconds
            appends = sum(r.appends_per_second for r in rs) * max(1, round(seconds)) or 1
            out[name][key] = {
                "subscriptions": rs[0].subscriptions,
                "rounds": len(rs),
                "appends_per_second": round(statistics.median(r.appends_per_second for r in rs)),
                "appends_per_second_each": [r.appends_per_second for r in rs],
                "p50_ms": round(statistics.median(r.p50_ms for r in rs), 2),
                "p99_ms": round(statistics.median(r.p99_ms for r in rs), 2),
                "errors": dict(errors),
                "cpu_seconds_per_round": {k: round(v / len(rs), 2) for k, v in cpu.items()},
                "cpu_ms_per_1k_appends": {k: round(1e6 * v / appends, 1) for k, v in cpu.items()},
                "redis_calls_per_1k_appends": {k: round(1000 * v / appends, 1) for k, v in calls.items()},
                "settle_seconds": round(statistics.median(r.settle_seconds for r in rs), 2),
                "machine_busy_percent": round(statistics.median(r.machine_busy_percent for r in rs)),
            }
        for base in ("ours", "reference"):
            if base in out[name] and f"{base}+subs" in out[name]:
                without = out[name][base]["appends_per_second"]
                with_ = out[name][f"{base}+subs"]["appends_per_second"]
                out[name][f"{base} ratio"] = round(with_ / without, 3) if without else None
                cpu_without = sum(out[name][base]["cpu_ms_per_1k_appends"].values())
                cpu_with = sum(out[name][f"{base}+subs"]["cpu_ms_per_1k_appends"].values())
                out[name][f"{base} cpu ratio"] = round(cpu_with / cpu_without, 3) if cpu_without else None
    return out


# -- part 2: webhooks -----------------------------------------------------------------------


class Receiver:
    """The webhook receiver: answers ``{"done": true}`` at once and notes, per run tag,
    (arrival, stream path, tail offset, subscription) of every stream a webhook names."""

    def __init__(self) -> None:
        self.port = free_port()
        self.hooks: dict[str, list[tuple[float, str, str, str]]] = defaultdict(list)
        self.arrivals: dict[str, list[float]] = defaultdict(list)  # per tag, one per webhook
        self.tails: dict[str, dict[str, str]] = defaultdict(dict)  # tag -> path -> highest tail
        self.empty: dict[str, list[str]] = defaultdict(list)  # per tag: webhooks naming no stream

    def url(self, tag: str) -> str:
        return f"http://127.0.0.1:{self.port}/hook/{tag}"

    async def handle(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        tag = request.match_info["tag"]
        raw = await request.read()
        body = json.loads(raw)
        self.arrivals[tag].append(arrived)
        if not body.get("streams"):  # not something a server should send: kept for a report
            self.empty[tag].append(raw.decode(errors="replace")[:1000])
        tails = self.tails[tag]
        for s in body.get("streams", []):
            path, tail = s["path"], s["tail_offset"]
            self.hooks[tag].append((arrived, path, tail, body.get("subscription_id", "")))
            if tail > tails.get(path, ""):
                tails[path] = tail
        return web.json_response({"done": True})

    @contextlib.asynccontextmanager
    async def running(self):
        app = web.Application()
        app.router.add_post("/hook/{tag}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        try:
            yield self
        finally:
            await runner.cleanup()


def percentile_ms(values: Sequence[float], p: float) -> float | None:
    """The ``p`` quantile of ``values`` (seconds) in ms; None if there are none."""
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(p * len(ordered)))], 2) if ordered else None


@dataclass
class WebhookRun:
    server: str
    mode: str  # paced | max
    round: int
    streams: int
    subscriptions: int
    seconds: float
    appends: int
    appends_per_second: float
    append_errors: dict[str, int]
    append_p50_ms: float | None
    append_p99_ms: float | None
    webhooks: int
    webhooks_per_second: float  # arrived while the writers wrote
    appends_per_webhook: float | None
    webhooks_covering_nothing: int  # naming streams, but none past what earlier ones covered
    webhooks_naming_no_stream: int  # "streams": [] (or none)
    example_naming_no_stream: str | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    latency_max_ms: float | None
    sent_latency_p50_ms: float | None  # from when the append was sent, not from its 2xx
    sent_latency_p99_ms: float | None
    uncovered: int  # appends no webhook covered by the end of the drain
    drain_seconds: float  # from the writers' end until the last append was covered
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # over the writing and the drain
    metered_seconds: float = 0.0  # how long that was
    machine_busy_percent: float = 0.0


async def webhook_once(
    server: Server, receiver: Receiver, mode: str, round_: int, args: argparse.Namespace
) -> WebhookRun:
    tag = f"wh-{server.key}-{mode}-{round_}-{uuid.uuid4().hex[:6]}"
    base = server.running.base_url
    paths = [f"{tag}/s{i}" for i in range(args.streams)]
    per_stream = args.webhook_subscriptions == "per-stream"
    subs = [f"{tag}-s{i}" for i in range(args.streams)] if per_stream else [tag]
    appended: dict[str, list[tuple[str, float, float]]] = defaultdict(list)  # (offset, 2xx, sent)
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    connector = aiohttp.TCPConnector(limit=args.streams + 8)
    timeout = aiohttp.ClientTimeout(total=30)
    headers = client_headers(server.kind)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as http:

        async def put(url: str, **kw) -> None:
            async with http.put(url, **kw) as r:
                if r.status not in (200, 201):
                    raise RuntimeError(f"PUT {url} {kw.get('json', '')}: {r.status} {await r.text()}")

        def sub_body(streams: list[str] | None) -> dict:
            body: dict = {"type": "webhook", "webhook": {"url": receiver.url(tag)}, "lease_ttl_ms": 30000}
            return body | ({"streams": streams} if streams else {"pattern": f"{tag}/*"})

        text = {"Content-Type": "text/plain"}
        if not per_stream:
            await put(subscription_url(server, tag), json=sub_body(None))
        await asyncio.gather(*(put(f"{base}/{p}", headers=text) for p in paths))
        if per_stream:
            await asyncio.gather(
                *(
                    put(subscription_url(server, s), json=sub_body([p]))
                    for s, p in zip(subs, paths, strict=True)
                )
            )
        await asyncio.sleep(0.5)  # ours: new streams matched against the pattern by the worker

        async def writer(i: int, began: float, deadline: float) -> None:
            url = f"{base}/{paths[i]}"
            interval = args.streams / args.rate if mode == "paced" else 0.0
            n = 0
            while True:
                due = began + (i / args.streams + n) * interval
                now = time.monotonic()
                if due >= deadline or now >= deadline:
                    return
                if due > now:
                    await asyncio.sleep(due - now)
                sent = time.monotonic()
                try:
                    async with http.post(url, data=BODY, headers=text) as r:
                        await r.read()
                        acked = time.monotonic()
                        if r.status in (200, 204):
                            appended[paths[i]].append((r.headers["Stream-Next-Offset"], acked, sent))
                            latencies.append(acked - sent)
                        else:
                            errors[str(r.status)] += 1
                except (TimeoutError, aiohttp.ClientError) as exc:
                    errors[type(exc).__name__] += 1
                n += 1

        meter = Meter(server)
        with meter:
            began = time.monotonic()
            deadline = began + args.seconds
            await asyncio.gather(*(writer(i, began, deadline) for i in range(args.streams)))
            ended = time.monotonic()
            # drain: until every stream's last append is covered
            last = {p: max(o for o, *_ in a) for p, a in appended.items() if a}
            drain_deadline = ended + args.drain_seconds
            while time.monotonic() < drain_deadline:
                tails = receiver.tails[tag]
                if all(tails.get(p, "") >= o for p, o in last.items()):
                    break
                await asyncio.sleep(0.02)

        async def delete(url: str) -> None:
            async with http.delete(url) as r:
                if r.status != 204:
                    print(f"DELETE {url}: {r.status} {await r.text()}", flush=True)

        await asyncio.gather(*(delete(subscription_url(server, s)) for s in subs))
    hooks = sorted(receiver.hooks.pop(tag, []))
    arrivals = receiver.arrivals.pop(tag, [])
    empty = receiver.empty.pop(tag, [])
    count = len(arrivals)
    receiver.tails.pop(tag, None)
    # each append: the first webhook (by arrival) naming its stream at or past its offset
    by_path: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for arrived, path, tail, _ in hooks:
        by_path[path].append((arrived, tail))
    wait: list[float] = []  # from the append's 2xx
    wait_sent: list[float] = []  # from when it was sent
    useless = 0
    last_cover = ended
    for path, entries in by_path.items():
        pending = sorted(appended.get(path, []))
        j = 0
        for arrived, tail in entries:
            k = j
            while j < len(pending) and pending[j][0] <= tail:
                wait.append(arrived - pending[j][1])
                wait_sent.append(arrived - pending[j][2])
                j += 1
            if j == k:
                useless += 1
            else:
                last_cover = max(last_cover, arrived)
    total = sum(len(a) for a in appended.values())
    during = sum(1 for arrived in arrivals if began <= arrived <= ended)
    return WebhookRun(
        server=server.key,
        mode=mode,
        round=round_,
        streams=args.streams,
        subscriptions=len(subs),
        seconds=round(ended - began, 2),
        appends=total,
        appends_per_second=round(total / (ended - began), 1),
        append_errors=dict(errors),
        append_p50_ms=percentile_ms(latencies, 0.5),
        append_p99_ms=percentile_ms(latencies, 0.99),
        webhooks=count,
        webhooks_per_second=round(during / (ended - began), 1),
        appends_per_webhook=round(total / count, 2) if count else None,
        webhooks_covering_nothing=useless,
        webhooks_naming_no_stream=len(empty),
        example_naming_no_stream=empty[0] if empty else None,
        latency_p50_ms=percentile_ms(wait, 0.5),
        latency_p99_ms=percentile_ms(wait, 0.99),
        latency_max_ms=percentile_ms(wait, 1.0),
        sent_latency_p50_ms=percentile_ms(wait_sent, 0.5),
        sent_latency_p99_ms=percentile_ms(wait_sent, 0.99),
        uncovered=total - len(wait),
        drain_seconds=round(last_cover - ended, 2),
        cpu_seconds=meter.cpu,
        metered_seconds=round(meter.seconds, 2),
        machine_busy_percent=meter.machine_busy_percent,
    )


def part_webhooks(args: argparse.Namespace, kinds: Sequence[str]) -> dict:
    modes = args.modes.split(",")
    runs: list[WebhookRun] = []
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(serve("ours" if k.startswith("ours") else "reference", k, args))
            for k in kinds
        ]

        async def everything() -> None:
            async with Receiver().running() as receiver:
                if args.warmup_seconds:
                    warm = argparse.Namespace(**{**vars(args), "seconds": args.warmup_seconds})
                    for server in servers:
                        await webhook_once(server, receiver, "paced", -1, warm)
                for round_ in range(args.rounds):
                    for i, mode in enumerate(modes):
                        shift = (round_ + i) % len(servers)
                        for server in servers[shift:] + servers[:shift]:
                            run = await webhook_once(server, receiver, mode, round_, args)
                            runs.append(run)
                            print(f"round {round_} webhooks {mode:<6} {server.key:<10} "
                                  f"{run.appends_per_second:>8,.0f} appends/s → "
                                  f"{run.webhooks_per_second:>7,.0f} webhooks/s ({run.appends_per_webhook} "
                                  f"appends each), append→webhook p50 {run.latency_p50_ms} "
                                  f"p99 {run.latency_p99_ms} max {run.latency_max_ms} ms, "
                                  f"uncovered {run.uncovered}, drain {run.drain_seconds} s, errors "
                                  f"{run.append_errors}, cpu {run.cpu_seconds}", flush=True)  # fmt: skip
                            if run.webhooks_naming_no_stream:
                                print(f"  {run.webhooks_naming_no_stream:,} webhooks named no stream, e.g. "
                                      f"{run.example_naming_no_stream}", flush=True)  # fmt: skip

        asyncio.run(everything())
    return {"summary": summarize_webhooks(runs), "runs": [asdict(r) for r in runs]}


def summarize_webhooks(runs: Sequence[WebhookRun]) -> dict:
    by: dict[str, dict[str, list[WebhookRun]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by[run.mode][run.server].append(run)
    out: dict[str, dict] = {}
    for mode, servers in by.items():
        out[mode] = {}
        for key, rs in servers.items():

            def median(attr: str, rs: list[WebhookRun] = rs) -> float | None:
                values = [getattr(r, attr) for r in rs if getattr(r, attr) is not None]
                return round(statistics.median(values), 2) if values else None

            errors: Counter[str] = Counter()
            cpu: Counter[str] = Counter()
            for r in rs:
                errors.update(r.append_errors)
                cpu.update(r.cpu_seconds)
            seconds = sum(r.metered_seconds for r in rs) or 1
            out[mode][key] = {
                "rounds": len(rs),
                "streams": rs[0].streams,
                "subscriptions": rs[0].subscriptions,
                **{
                    a: median(a)
                    for a in (
                        "appends_per_second",
                        "webhooks_per_second",
                        "appends_per_webhook",
                        "latency_p50_ms",
                        "latency_p99_ms",
                        "latency_max_ms",
                        "sent_latency_p50_ms",
                        "sent_latency_p99_ms",
                        "append_p50_ms",
                        "append_p99_ms",
                        "drain_seconds",
                        "machine_busy_percent",
                    )
                },
                "webhooks_per_second_each": [r.webhooks_per_second for r in rs],
                "latency_p99_ms_each": [r.latency_p99_ms for r in rs],
                "uncovered": sum(r.uncovered for r in rs),
                "webhooks_covering_nothing": sum(r.webhooks_covering_nothing for r in rs),
                "webhooks_naming_no_stream": sum(r.webhooks_naming_no_stream for r in rs),
                "append_errors": dict(errors),
                "cpu_percent": {k: round(100 * v / seconds, 1) for k, v in cpu.items()},
            }
    return out


# -- output ---------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _scenario_title(name: str) -> str:
    writers, streams, size, _ = scenario(name)
    where = "one stream" if streams == 1 else f"{streams:,} streams"
    return f"{writers} writers, {where}, {size} B"


def appends_table(part: dict, config: dict) -> str:
    summary = part["summary"]
    n = f"{config['subscriptions']:,}"
    columns: list[tuple[str, str]] = []
    for base, title in (("ours", "ours"), ("reference", config["reference_kind"])):
        if any(base in s for s in summary.values()):
            columns += [
                (base, f"{title}, no subscriptions"),
                (f"{base}+subs", f"{title}, {n} subscriptions"),
                (f"{base} ratio", "with / without"),
            ]
    lines = [
        f"| appends, median of {config['rounds']} rounds | " + " | ".join(t for _, t in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name, by in summary.items():
        cells = []
        for key, _ in columns:
            e = by.get(key)
            if e is None:
                cells.append("–")
            elif key.endswith("ratio"):
                cells.append(f"**{e:.2f}**")
            else:
                errors = sum(e["errors"].values())
                extra = f" (+{errors:,} errors)" if errors else ""
                cells.append(f"{e['appends_per_second']:,}/s, p99 {_ms(e['p99_ms'])} ms{extra}")
        lines.append(f"| {_scenario_title(name)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"| server CPU, ms per 1,000 appends (sum of {config['rounds']} rounds) | "
        + " | ".join(t for _, t in columns)
        + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name, by in summary.items():
        cells = []
        for key, _ in columns:
            if key.endswith("ratio"):
                e = by.get(key.replace("ratio", "cpu ratio"))
                cells.append("–" if e is None else f"**{e:.2f}**")
            elif key in by:
                cpu = by[key]["cpu_ms_per_1k_appends"]
                parts = " + ".join(f"{v:,.0f} {k}" for k, v in cpu.items())
                cells.append(f"{sum(cpu.values()):,.0f} ({parts})" if len(cpu) > 1 else f"{parts}")
            else:
                cells.append("–")
        lines.append(f"| {_scenario_title(name)} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    for key, reg in part["registration"].items():
        text += (
            f"\n- {key}: {reg['subscriptions']:,} pattern subscriptions registered in {reg['seconds']} s "
            f"({reg['per_second']:,.0f}/s, {reg['concurrency']} PUTs at a time; statuses {reg['statuses']})"
        )
        if "backfill_done_seconds" in reg:
            done = reg["backfill_done_seconds"]
            text += (
                f"; the deliver worker had backfilled them all {done} s after the first PUT"
                if done is not None
                else f"; {reg['backfills_left']:,} backfills still to do at the timeout"
            )
            text += f" (worker CPU {reg['worker_cpu_seconds_since_ready']} s)"
    for name, by in summary.items():
        for key in ("ours", "ours+subs"):
            settle = by.get(key, {}).get("settle_seconds", 0)
            if settle >= 0.05:
                text += (
                    f"\n- {key}, {_scenario_title(name)}: each run's new streams waited for in the"
                    f" worker's outbox before its load started: {settle} s (median)"
                )
    return text + "\n"


WEBHOOK_ROWS = (
    ("appends/s", lambda e: f"{e['appends_per_second']:,.0f}"),
    ("webhooks/s (while writing)", lambda e: f"{e['webhooks_per_second']:,.0f}"),
    (
        "appends per webhook",
        lambda e: "–" if e["appends_per_webhook"] is None else f"{e['appends_per_webhook']:.2f}",
    ),
    (
        "append 2xx → webhook, p50 / p99",
        lambda e: f"{_ms(e['latency_p50_ms'])} / {_ms(e['latency_p99_ms'])} ms",
    ),
    (
        "append sent → webhook, p50 / p99",
        lambda e: f"{_ms(e['sent_latency_p50_ms'])} / {_ms(e['sent_latency_p99_ms'])} ms",
    ),
    ("append latency, p50 / p99", lambda e: f"{_ms(e['append_p50_ms'])} / {_ms(e['append_p99_ms'])} ms"),
    ("appends never covered (all rounds)", lambda e: f"{e['uncovered']:,}"),
    ("webhooks naming no stream (all rounds)", lambda e: f"{e['webhooks_naming_no_stream']:,}"),
    (
        "server CPU, % of one core",
        lambda e: " + ".join(f"{v:.0f} {k}" for k, v in e["cpu_percent"].items()),
    ),
)


def webhooks_table(part: dict, config: dict) -> str:
    summary = part["summary"]
    servers = list(dict.fromkeys(k for by in summary.values() for k in by))
    titles = [config["reference_kind"] if s == "reference" else s for s in servers]
    lines = [
        f"| webhooks, median of {config['rounds']} rounds | | " + " | ".join(titles) + " |",
        "|---|---|" + "---:|" * len(servers),
    ]
    for mode, by in summary.items():
        first = by[servers[0]]
        what = (
            f"{config['rate']:,.0f} appends/s paced"
            if mode == "paced"
            else f"{first['streams']} writers back to back"
        )
        label = f"{mode}: {first['streams']} streams, {first['subscriptions']} subscription(s), {what}"
        for i, (name, cell) in enumerate(WEBHOOK_ROWS):
            lines.append(
                f"| {label if i == 0 else ''} | {name} | "
                + " | ".join(cell(by[s]) if s in by else "–" for s in servers)
                + " |"
            )
    return "\n".join(lines) + "\n"


def plot(document: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("appends", "webhooks") if p in document]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    for ax, part in zip(axes[0], panels, strict=True):
        summary = document[part]["summary"]
        groups = list(summary)
        if part == "appends":
            keys_ = [
                k
                for k in ("ours", "ours+subs", "reference", "reference+subs")
                if any(k in summary[g] for g in groups)
            ]
            width = 0.8 / len(keys_)
            colors = {
                "ours": "#3f7fd0",
                "ours+subs": "#1f4e99",
                "reference": "#e8871e",
                "reference+subs": "#b35900",
            }
            for j, key in enumerate(keys_):
                xs = [i + (j - (len(keys_) - 1) / 2) * width for i in range(len(groups))]
                ys = [summary[g].get(key, {}).get("appends_per_second", 0) for g in groups]
                label = key.replace("+subs", f" + {document['config']['subscriptions']:,} subscriptions")
                bars = ax.bar(xs, ys, width, label=label, color=colors[key])
                ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7)
            ax.set_xticks(range(len(groups)), [_scenario_title(g) for g in groups], fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("appends/s (median of rounds)")
            ax.set_title("Appends beside non-matching pattern subscriptions", fontsize=10)
        else:
            servers = list(dict.fromkeys(k for by in summary.values() for k in by))
            width = 0.8 / (2 * len(servers))
            j = 0
            for server in servers:
                for stat, alpha in (("latency_p50_ms", 1.0), ("latency_p99_ms", 0.5)):
                    xs = [i + (j - (2 * len(servers) - 1) / 2) * width for i in range(len(groups))]
                    ys = [max(0.01, summary[g].get(server, {}).get(stat) or 0) for g in groups]
                    color = "#3f7fd0" if server.startswith("ours") else "#e8871e"
                    bars = ax.bar(
                        xs, ys, width, color=color, alpha=alpha, label=f"{server} {stat.split('_')[1]}"
                    )
                    ax.bar_label(bars, labels=[_ms(y) for y in ys], fontsize=7)
                    j += 1
            ax.set_yscale("log")
            ax.set_xticks(range(len(groups)), groups)
            ax.set_ylabel("append 2xx → covering webhook, ms")
            ax.set_title("Webhook latency (median of rounds' p50 and p99)", fontsize=10)
        ax.set_ylim(top=ax.get_ylim()[1] * 8)  # room for the legend above the bars (log scale)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncols=2)
    fig.suptitle("Durable Streams subscriptions, one run on one shared 2-core machine")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write(document: dict, out: Path) -> None:
    config = document["config"]
    text = ""
    if "appends" in document:
        text += (
            "Appends (wrk, loadtest/appends.py) to streams no subscription matches, on servers with no"
            f" subscriptions and with {config['subscriptions']:,} webhook subscriptions whose patterns"
            " match none of them (ours: with a deliver worker running, and each run starting once the"
            " worker has taken the run's new streams from its outbox: with pattern subscriptions each"
            " new stream is matched against them once, a cost of making streams, not of appends)."
            " Interleaved rounds of"
            f" {config['seconds']:g} s.\n\n" + appends_table(document["appends"], config)
        )
    if "webhooks" in document:
        text += (
            '\nWebhooks to a receiver in the load generator\'s process that answers {"done": true}'
            " (the server auto-acks the wake); latency from an append's 2xx to the first webhook"
            " naming its stream at or past its Stream-Next-Offset (below zero: the webhook came before"
            " the load generator, busy, had read the append's response; from when the append was sent"
            " too); one webhook may cover many appends. Interleaved rounds of"
            f" {config['seconds']:g} s.\n\n" + webhooks_table(document["webhooks"], config)
        )
        if config.get("worker_redis_url"):
            text += "\nOurs' deliver worker was given --redis-url unix://<data dir>/redis.sock.\n"
        else:
            text += "\nOurs' deliver worker found the gateway's embedded Redis by --data-dir.\n"
    text += (
        f"\nMachine: {config['cores']} cores, busy {config['machine_busy_before_percent']}% before the"
        f" run (of {100 * config['cores']}%); whole run {config['wall_seconds']} s."
    )
    code = config.get("code", {})
    if code:
        text += f" Code: commit {code['commit'][:12]}"
        text += f", changed since: {', '.join(code['changed'])}" if code["changed"] else ""
        text += " (**and changed during the run**)" if config.get("code_changed_during_run") else ""
        text += "."
    text += "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    plot(document, out.with_suffix(".png"))
    print()
    print(text)
    print(f"wrote {out}.json, .md" + (", .png" if out.with_suffix(".png").exists() else ""))


def summarized_again(document: dict) -> dict:
    """A document written before, its summaries made anew from its runs (``--from-json``)."""
    config = document["config"]
    if "appends" in document:
        runs = [AppendRun(**r) for r in document["appends"]["runs"]]
        document["appends"]["summary"] = summarize_appends(runs, config["seconds"])
    if "webhooks" in document:
        runs = [WebhookRun(**r) for r in document["webhooks"]["runs"]]
        document["webhooks"]["summary"] = summarize_webhooks(runs)
    return document


def code_version() -> dict:
    """The commit measured, and the server's files changed since (gateway/, workers/, lua/)."""
    root = Path(__file__).resolve().parent.parent

    def git(*command: str) -> str:
        try:
            return subprocess.run(["git", *command], cwd=root, capture_output=True, text=True).stdout
        except OSError:
            return ""

    changed = git("status", "--porcelain", "--", "gateway", "workers", "lua")
    diff = git("diff", "HEAD", "--", "gateway", "workers", "lua")
    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "changed": [line[3:] for line in changed.splitlines()],
        "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12],
    }


# -- main -----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.subscriptions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per run (both parts)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="appends,webhooks", help="comma list of appends, webhooks")
    parser.add_argument("--servers", default="ours,reference", help="comma list of ours, reference")
    parser.add_argument(
        "--reference-kind",
        default="reference",
        choices=("reference", "reference-memory"),
        help="the reference server file-backed (its durable mode) or in memory",
    )
    parser.add_argument(
        "--subscriptions", type=int, default=10_000, help="non-matching pattern subscriptions"
    )
    parser.add_argument(
        "--register-concurrency", type=int, default=64, help="PUTs in flight while registering"
    )
    parser.add_argument(
        "--backfill-timeout",
        type=float,
        default=300.0,
        help="ours: seconds to wait for the worker's backfills before the rounds",
    )
    parser.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS), help="of loadtest/appends.py")
    parser.add_argument("--streams", type=int, default=100, help="webhooks: streams written")
    parser.add_argument(
        "--webhook-subscriptions",
        choices=("per-stream", "pattern"),
        default="per-stream",
        help="webhooks: one subscription per stream, or one pattern over them all",
    )
    parser.add_argument("--modes", default="paced,max", help="webhooks: comma list of paced, max")
    parser.add_argument(
        "--rate", type=float, default=200.0, help="webhooks, paced: appends/s over all streams"
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=15.0,
        help="webhooks: how long to wait after the writers for the last webhooks",
    )
    parser.add_argument(
        "--warmup-seconds", type=float, default=1.0, help="a first run per server, not counted"
    )
    parser.add_argument(
        "--worker-redis-url",
        action="store_true",
        help="ours: give the deliver worker --redis-url unix://<data dir>/redis.sock rather than letting it"
        " find the gateway's embedded Redis by --data-dir (the same Redis either way)",
    )
    parser.add_argument("--out", default="loadtest/results/subscriptions")
    parser.add_argument(
        "--from-json", type=Path, help="no run: the summaries, tables and plot again from this"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        write(summarized_again(json.loads(args.from_json.read_text())), Path(args.out))
        return
    parts = args.parts.split(",")
    kinds = [("ours" if s == "ours" else args.reference_kind) for s in args.servers.split(",")]
    use_uvloop()
    idle = machine_busy_percent(2.0)
    print(f"machine busy before starting: {idle:.0f}% (of {100 * cores()}%)", flush=True)
    began = time.monotonic()
    code = code_version()  # others may be editing the server meanwhile: looked at again at the end
    document: dict = {}
    if "appends" in parts:
        document["appends"] = part_appends(args, kinds)
    if "webhooks" in parts:
        document["webhooks"] = part_webhooks(args, kinds)
    document = {
        "config": {
            "seconds": args.seconds,
            "rounds": args.rounds,
            "subscriptions": args.subscriptions,
            "register_concurrency": args.register_concurrency,
            "scenarios": args.scenarios.split(","),
            "servers": kinds,
            "reference_kind": args.reference_kind,
            "streams": args.streams,
            "webhook_subscriptions": args.webhook_subscriptions,
            "modes": args.modes.split(","),
            "rate": args.rate,
            "worker_redis_url": args.worker_redis_url,
            "wall_seconds": round(time.monotonic() - began),
            "machine_busy_before_percent": round(idle),
            "cores": cores(),
            "code": code,
            "code_changed_during_run": code_version() != code,
        },
        **document,
    }
    write(document, Path(args.out))


if __name__ == "__main__":
    main()
