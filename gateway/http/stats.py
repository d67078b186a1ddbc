"""The live statistics of the web console's overview, as JSON, read from Redis
(features/stats.py), so every gateway answers the same:

- ``GET {prefix}/__ds/stats[?minutes=15]``: appends/s, bytes/s, live readers (SSE,
  long-poll), archive lag and subscription backlog, per 10 s over the last minutes (1 to
  60), and the figures now. Needs ``read`` on every stream (a grant of ``read:*`` or more):
  it sums them all.
- ``GET {prefix}/__ds/stats/streams/{path}``: one stream's live readers on every gateway
  and its write rate (bytes/s, sampled by these requests). Needs ``read`` on the stream.
- ``GET {prefix}/__ds/stats/subscriptions``: the subscriptions a gateway finds without a
  SCAN (with a pattern, or with something scheduled), each with its state; those whose
  ``__ds/subscriptions/<id>`` the credential may read (401 without credentials that may
  read any).

Served, and recorded (``install``: each process' recorder task), when the console is
(``--console``: console.enabled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from ..config import Settings
from ..features.stats import DEFAULT_MINUTES, MAX_MINUTES, Recorder
from ..protocol.errors import ProtocolError
from ..protocol.listing import check_listable, readable_prefixes
from ..protocol.namespace import RESERVED
from ..redis_io import keys
from . import console
from .context import GATEWAY, gateway_of
from .handlers import options_stream, stream_name
from .subscriptions import control_path

log = logging.getLogger(__name__)
RECORDER = web.AppKey("stats_recorder", Recorder)
RECORDER_TASK = web.AppKey("stats_recorder_task", asyncio.Task)
STOP_SECONDS = 2.0  # the recorder's last tick at shutdown, at most
NO_STORE = {"Cache-Control": "no-store"}


def _minutes(query: Mapping[str, str]) -> int:
    raw = query.get("minutes", str(DEFAULT_MINUTES))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_MINUTES:
        raise ProtocolError(400, f"minutes must be a whole number from 1 to {MAX_MINUTES}")
    return int(raw)


async def overview(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    await gw.guard.admit_path(request, "", "read")  # every stream's figures: read on all of them
    body = await gw.store.stats.overview(_minutes(request.query))
    return web.json_response(body, headers=NO_STORE)


async def one_stream(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    path = stream_name(request.match_info["path"], gw.settings.max_path_bytes)
    await gw.guard.admit_path(request, path, "read")
    sid = keys.stream_id(path)
    listed = await gw.store.listing.one(sid, producers=0)
    if listed is None:
        raise ProtocolError(404, "stream not found")
    body: dict[str, Any] = {
        "path": path,
        "status": "closed" if listed.meta.closed else "open",
        "bytes": listed.meta.tail,
        "last_write_at_ms": listed.last_write_ms,
    }
    body.update(await gw.store.stats.stream(sid, listed.meta.tail))
    return web.json_response(body, headers=NO_STORE)


async def subscriptions(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    under = f"{RESERVED}/subscriptions/"
    principal = await gw.guard.admit_listing(request, under)
    check_listable(principal, readable_prefixes(principal, under))
    body = await gw.store.stats.subscriptions(lambda sub: principal.allows("read", control_path(sub)))
    return web.json_response(body, headers=NO_STORE)


def routes(settings: Settings) -> list[tuple[str, str, dict[str, Any]]]:
    """(route name, path, handlers by method), routed before the streams; none when the
    console is off."""
    if not console.enabled(settings)[0]:
        return []
    base = f"{settings.prefix.rstrip('/')}/{RESERVED}/stats"
    return [
        ("stats", base, {"GET": overview, "OPTIONS": options_stream}),
        ("stats", f"{base}/subscriptions", {"GET": subscriptions, "OPTIONS": options_stream}),
        ("stats", f"{base}/streams/{{path:.+}}", {"GET": one_stream, "OPTIONS": options_stream}),
    ]


def install(app: web.Application, settings: Settings) -> None:
    """This process' recorder: started after the app's own startup (it needs the
    gateway's Redis and fan-out), stopped at shutdown before Redis closes."""
    if not console.enabled(settings)[0]:
        return

    async def start(app: web.Application) -> None:
        gw = app[GATEWAY]
        recorder = gw.store.stats.recorder(gw.fanout.readers)
        app[RECORDER] = recorder
        app[RECORDER_TASK] = asyncio.create_task(recorder.run(lambda: gw.preflight.ready), name="stats")

    async def stop(app: web.Application) -> None:
        task = app.get(RECORDER_TASK)
        if task is None:
            return
        app[RECORDER].stop()
        try:
            await asyncio.wait_for(task, STOP_SECONDS)
        except Exception as exc:  # TimeoutError included: shutting down goes on
            log.debug("console statistics: the recorder did not stop cleanly (%s)", exc)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
