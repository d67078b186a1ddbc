"""The gateway's lifecycle on Redis: what starts with the app (the clients, the Store, the
fan-out, write backpressure, the start-up checks), how SIGTERM drains it behind a load
balancer, and how it stops (each step bounded)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable

from aiohttp import web

from ..archive.cold import ColdReader
from ..archive.files import Archive
from ..concurrency.budget import ByteBudget
from ..config import Settings
from ..features.backpressure import WritePause
from ..features.hints import HintKeys
from ..features.ratelimit import RateLimiter
from ..features.tenants import TenantRates
from ..live.fanout import Fanout
from ..protocol.ssrf import parse_allow_list
from ..redis_io import connections as redis_client
from ..redis_io.fleet import Membership
from ..redis_io.preflight import Preflight
from ..redis_io.scripts import connect_scripts, replica_ack
from ..streams.store import Store
from ..telemetry import metrics
from .bodies import BodyBudget
from .context import GATEWAY, Gateway
from .guard import Guard

log = logging.getLogger(__name__)
CLEANUP_STEP_SECONDS = 5.0  # each shutdown step; none may hold a shutdown past its grace period
PAUSE_TASK = web.AppKey("pause_task", asyncio.Task)  # write backpressure's polls (features/backpressure.py)
PREFLIGHT_TASK = web.AppKey("preflight_task", asyncio.Task)
MEMBER = web.AppKey("member", Membership)
MEMBER_TASK = web.AppKey("member_task", asyncio.Task)


def install(
    app: web.Application,
    settings: Settings,
    redis_url: str,
    guard: Guard,
    *,
    on_refusal: Callable[[str], None],
    drain_on_sigterm: bool,
) -> None:
    """Start on ``redis_url`` with the app, stop with it (see the module)."""

    async def startup(app: web.Application) -> None:
        # Nothing here waits for Redis: clients connect on first use, the fan-out's
        # listener and the hints task retry by themselves.
        # Its slot-map reads must not hang on one silent node (the listeners set their own).
        timeouts = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0} if settings.redis_cluster else {}
        pubsub_client = redis_client.general(redis_url, cluster=settings.redis_cluster, **timeouts)
        fanout = Fanout(pubsub_client)
        scripts = connect_scripts(
            redis_url,
            cluster=settings.redis_cluster,
            max_connections=settings.redis_max_connections,
            timeout=settings.redis_timeout,
            replica_ack=replica_ack(settings.min_replicas_ack, settings.min_replicas_ack_timeout),
            answered=fanout.redis_answered,  # Redis is back: live readers' listener reconnects now
        )
        cold = ColdReader(Archive(settings.archive_location), settings.archive_cache_bytes)
        store = Store(
            scripts,
            cold,
            settings.max_chunk_bytes,
            settings.notice_payload_bytes,
            settings.read_inline_bytes,
            settings.read_page_bytes,
            archive_hints=settings.archive_hints,
            stream_registry=settings.stream_registry,
            compaction_prefixes=settings.compaction_prefix_list,
            tenants=settings.tenants,
            tenant_metrics_top=settings.tenant_metrics_top,
        )
        app[MEMBER] = member = Membership(scripts.redis, "gateway")
        preflight = Preflight(
            scripts.redis,
            persistence=True,
            require_durable=settings.require_durable,
            prepare=scripts.load,
            durable=lambda durable: metrics.DURABLE.set(1 if durable else 0),
            member=member,
        )
        metrics.LIVE_CAPACITY.set(settings.max_live_connections)
        await fanout.start()
        pause = WritePause(
            scripts.redis,
            HintKeys.of_client(scripts.redis),
            memory=settings.write_pause_memory,
            archive_lag=settings.write_pause_archive_lag,
            retry_after=settings.write_pause_retry_after,
        )
        guard.attach(RateLimiter(scripts), pause, TenantRates(scripts))
        app[GATEWAY] = Gateway(
            settings=settings,
            store=store,
            fanout=fanout,
            bodies=BodyBudget(settings.max_inflight_body_bytes),
            guard=guard,
            preflight=preflight,
            reads=ByteBudget(settings.max_inflight_read_bytes),
            codings=tuple(name for name in settings.compression.split(",") if name),
            webhook_policy=parse_allow_list(settings.webhook_allow),
        )
        store.start()
        app[PAUSE_TASK] = asyncio.create_task(pause.run())
        if not await preflight.attempt():  # a refusal is raised: the start fails
            log.warning(
                "redis not usable at start (%s): serving anyway; /readyz and stream requests answer "
                "503 until it is",
                preflight.problem,
            )
            app[PREFLIGHT_TASK] = asyncio.create_task(keep_trying(preflight, on_refusal))

        def refused_later(why: str) -> None:  # a renewal refused: the same as a refused start
            preflight.refusal = why
            on_refusal(why)

        app[MEMBER_TASK] = asyncio.create_task(member.keep(refused_later))
        if drain_on_sigterm:
            drain(app, settings.shutdown_delay_seconds)
            # What the process holds now (modules, the app, its clients) lives as long as it
            # does: out of the cycle collector's way. Its full collections walked all of it,
            # pausing every request for up to ~26 ms under load over 1,000 streams; ~2 ms after.
            gc.collect()  # (start-up's garbage first: frozen, it would never be freed)
            gc.freeze()

    async def shutdown(app: web.Application) -> None:
        app[GATEWAY].fanout.stop_waiters()  # live responses end cleanly, in-flight writes finish

    async def cleanup(app: web.Application) -> None:
        """Each step bounded: a Redis that does not answer must not hold the process."""
        gw = app.get(GATEWAY)
        if gw is None:  # the start failed before anything was built
            return
        for task in (app.get(PREFLIGHT_TASK), app.get(MEMBER_TASK)):
            if task is not None:
                task.cancel()
        if gw.guard.pause is not None:
            gw.guard.pause.stop()
        metrics.flush_requests()  # the last second's requests, into the metrics' files (multiprocess)
        for name, step in (
            ("fleet registry", app[MEMBER].leave()),
            ("access control", gw.guard.close()),
            ("write backpressure", app[PAUSE_TASK]),
            ("fan-out", gw.fanout.close()),
            ("store", gw.store.close(CLEANUP_STEP_SECONDS / 2)),  # two bounded steps
        ):
            try:
                await asyncio.wait_for(step, CLEANUP_STEP_SECONDS)
            except Exception as exc:  # TimeoutError included: go on with the next step
                log.warning("shutdown: %s did not close cleanly (%s)", name, exc or type(exc).__name__)

    app.on_startup.append(startup)
    app.on_shutdown.append(shutdown)
    app.on_cleanup.append(cleanup)


def stop_this_process(refusal: str) -> None:
    """A start-up check failed once Redis answered: stop gracefully (in-flight requests
    finish), without SIGTERM's delay: a process that was never ready is in no load balancer.
    ``durable-streams serve`` then exits non-zero with the refusal; a gunicorn worker is
    started again, refuses at once, and that stops gunicorn."""
    log.error("refusing to serve: %s", refusal)
    os.kill(os.getpid(), signal.SIGINT)


def drain(app: web.Application, delay: float) -> None:
    """SIGTERM starts the shutdown with ``delay`` seconds (--shutdown-delay-seconds) of still
    serving: /readyz answers 503, live responses end now (with their resume offset: readers
    reconnect, through the load balancer, elsewhere), every response closes its connection.
    Until a load balancer sees the probe fail, or its endpoints change, it keeps sending here;
    a proxy's keep-alive connection that this process closed while idle would meet its next
    request with a reset, and a POST it already sent is not retried: a 502. Closed after a
    response that says so, it is not reused (an event stream's connection, its headers out
    before, stays open: its next request gets the close). Then the process stops as on SIGINT,
    which both hosts (run_app; gunicorn's aiohttp worker) take as a graceful stop: the listener
    closes, idle connections close, in-flight requests get --shutdown-seconds.

    Installed from the app's startup, after the host's own handlers, so it replaces their
    SIGTERM one; SIGINT keeps theirs (a stop without the delay)."""
    loop = asyncio.get_running_loop()

    def begin() -> None:
        gw = app[GATEWAY]
        if gw.draining:  # a second SIGTERM changes nothing
            return
        gw.draining = True
        gw.fanout.stop_waiters()
        log.info("SIGTERM: not ready, closing connections after each response; stopping in %ss", delay)
        loop.call_later(delay, os.kill, os.getpid(), signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGTERM, begin)
    except NotImplementedError:  # Windows: SIGTERM stays the host's (a stop without the delay)
        pass


async def keep_trying(preflight: Preflight, on_refusal: Callable[[str], None]) -> None:
    """The start-up checks again, with backoff, until they pass or one refuses."""
    try:
        await preflight.wait()
    except Exception as exc:  # a refusal (durability, key layout)
        on_refusal(str(exc))
        return
    log.info("redis is ready: serving streams")
