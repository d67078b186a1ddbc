"""Sending wakes, for the delivery worker (``workers/delivery.py``): the webhook POST
(signed, spec 7.1) and the pull-wake events (spec 7.2, an ordinary append to the wake
stream). The only place that sends to a receiver.

Webhook targets are checked against the SSRF rules (protocol/ssrf.py) again at every
delivery, by the resolver the HTTP client connects through (``CheckedResolver``): what
is checked is what is connected to (no window for DNS rebinding), redirects are not
followed.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp.abc import AbstractResolver, ResolveResult

from gateway import __version__
from gateway.config import Settings
from gateway.features.subscriptions import TOKEN_TTL_MS, Subscriptions
from gateway.protocol import ssrf
from gateway.protocol.entries import pack_bytes, pack_messages
from gateway.protocol.errors import ProtocolError
from gateway.protocol.subscriptions import SubscriptionConfig, issue_token
from gateway.protocol.webhooks import SigningKey, signature_header
from gateway.redis_io import keys
from gateway.streams.store import Store
from gateway.telemetry import metrics
from gateway.telemetry.logs import RateLimited

from .clock import now_ms

log = logging.getLogger("durable_streams.deliver")
limited = RateLimited(log)
MAX_RESPONSE_BYTES = 64 * 1024  # of a webhook's answer: only {"done": true} matters


class TargetRejected(OSError):
    """A webhook host resolved to an address the SSRF rules refuse (at delivery)."""


class CheckedResolver(AbstractResolver):
    """aiohttp's resolver, answering only addresses the SSRF rules allow: the HTTP client
    connects to what was checked. An answer with any refused address is refused whole."""

    def __init__(self, policy: ssrf.TargetPolicy) -> None:
        self.policy = policy
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        try:
            allowed = {
                ipaddress.ip_address(a)
                for a in ssrf.check_addresses(host, [r["host"] for r in found], self.policy)
            }
        except ProtocolError as exc:
            raise TargetRejected(exc.message) from None
        return [r for r in found if ipaddress.ip_address(r["host"]) in allowed]

    async def close(self) -> None:
        await self._inner.close()


class Sender:
    """Delivers one wake: a webhook POST through an HTTP client that connects only where
    the SSRF rules allow, or pull-wake events appended to the wake stream."""

    def __init__(self, settings: Settings, subs: Subscriptions, store: Store) -> None:
        self.settings = settings
        self.subs = subs
        self.store = store
        self.policy = ssrf.parse_allow_list(settings.webhook_allow)
        self.session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """The HTTP client (made inside the running loop, as aiohttp wants)."""
        # No DNS cache: every delivery resolves (and checks) its host anew.
        connector = aiohttp.TCPConnector(resolver=CheckedResolver(self.policy), limit=0, use_dns_cache=False)
        self.session = aiohttp.ClientSession(
            connector=connector,
            headers={"User-Agent": f"durable-streams-redis/{__version__} (webhooks)"},
            timeout=aiohttp.ClientTimeout(total=self.settings.webhook_timeout),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def deliver(
        self,
        sub: str,
        gen: int,
        wake: str,
        config: SubscriptionConfig,
        streams: list[dict[str, Any]],
        base: str,
    ) -> str:
        """POST one wake (spec 7.1); the outcome for sub_result.lua."""
        assert self.session is not None and config.webhook_url is not None
        callback = f"{base}/__ds/subscriptions/{quote(sub, safe='')}/callback"
        token = issue_token(await self.subs.secret(), sub, gen, wake, "callback", TOKEN_TTL_MS, now_ms())
        body = orjson.dumps(
            {
                "subscription_id": sub,
                "wake_id": wake,
                "generation": gen,
                "streams": streams,
                "callback_url": callback,
                "callback_token": token,
            }
        )
        key: SigningKey = await self.subs.signing.signer()
        headers = {
            "Content-Type": "application/json",
            "Webhook-Signature": signature_header(key, body, int(time.time())),
        }
        started = time.perf_counter()
        outcome = "failed"
        try:
            ssrf.check_url(config.webhook_url, self.policy)
            async with self.session.post(
                config.webhook_url, data=body, headers=headers, allow_redirects=False
            ) as resp:
                answer = await resp.content.read(MAX_RESPONSE_BYTES)
                if 200 <= resp.status < 300:
                    outcome = "done" if _says_done(answer) else "accepted"
                else:
                    limited.log(
                        logging.INFO, "status", "webhook of %r answered %d: retrying", sub, resp.status
                    )
        except ProtocolError as exc:
            outcome = "rejected"
            limited.log(
                logging.WARNING, "rejected", "webhook of %r refused at delivery: %s", sub, exc.message
            )
        except Exception as exc:
            outcome = "rejected" if _rejected(exc) else "failed"
            limited.log(
                logging.INFO,
                "unreachable",
                "webhook of %r failed (%s): retrying",
                sub,
                exc or type(exc).__name__,
            )
        metrics.WEBHOOK_SECONDS.observe(time.perf_counter() - started)
        metrics.WEBHOOK_DELIVERIES.labels(outcome).inc()
        if outcome in ("done", "accepted"):
            metrics.WAKES.labels("webhook").inc()
        return "failed" if outcome == "rejected" else outcome

    async def emit(
        self, sub: str, gen: int, config: SubscriptionConfig, streams: list[dict[str, Any]]
    ) -> bool:
        """Pull-wake (spec 7.2): one wake event per pending stream on the wake stream, an
        ordinary append (the application made the stream; until it does, retried)."""
        assert config.wake_stream is not None
        sid = keys.stream_id(config.wake_stream)
        try:
            meta = await self.store.head(sid)
        except ProtocolError:
            limited.log(
                logging.WARNING, "wake-stream", "wake stream %r of %r is missing", config.wake_stream, sub
            )
            return False
        now = now_ms()
        events = [
            orjson.dumps(
                {"type": "wake", "subscription_id": sub, "stream": s["path"], "generation": gen, "ts": now}
            )
            for s in streams
        ] or [
            orjson.dumps(
                {"type": "wake", "subscription_id": sub, "stream": None, "generation": gen, "ts": now}
            )
        ]
        json = meta.media_type == "application/json"
        entries = pack_messages(events) if json else pack_bytes(b"".join(e + b"\n" for e in events))
        try:
            await self.store.append(
                sid, meta.media_type, entries, close=False, stream_seq=None, producer=None
            )
        except ProtocolError as exc:  # closed, or its content type changed
            limited.log(
                logging.WARNING, "wake-stream", "wake stream of %r refused the event: %s", sub, exc.message
            )
            return False
        metrics.WAKES.labels("pull-wake").inc()
        return True


def _rejected(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TargetRejected) or isinstance(getattr(seen, "os_error", None), TargetRejected):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _says_done(answer: bytes) -> bool:
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and parsed.get("done") is True
