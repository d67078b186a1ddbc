"""What every handler needs, stored once on the aiohttp app."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from ..concurrency.budget import ByteBudget
from ..config import Settings
from ..live.fanout import Fanout
from ..protocol.ssrf import TargetPolicy
from ..redis_io.preflight import Preflight
from ..streams.store import Store
from .bodies import BodyBudget
from .guard import Guard


@dataclass
class Gateway:
    settings: Settings
    store: Store
    fanout: Fanout
    bodies: BodyBudget
    guard: Guard
    preflight: Preflight  # ready: Redis passed the start-up checks (until then stream requests get 503)
    # Pages held by streamed catch-up answers (--max-inflight-read-bytes), and the content
    # codings offered to catch-up reads (--compression): lifecycle.py sets both.
    reads: ByteBudget = field(default_factory=lambda: ByteBudget(256 * 1024 * 1024))
    codings: tuple[str, ...] = ()
    webhook_policy: TargetPolicy = field(default_factory=TargetPolicy)  # --webhook-allow: exempt targets
    # SIGTERM came: not ready, every response closes its connection (--shutdown-delay-seconds)
    draining: bool = False


GATEWAY = web.AppKey("gateway", Gateway)
# The body bytes a streamed answer (catch-up pages, an event stream) sent, as its client's
# decoder sees them (no chunk framing): what tenants' usage counts as bytes out (endpoint.py).
BODY_SENT = web.RequestKey("body_sent", int)


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]
