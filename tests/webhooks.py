"""A webhook receiver for the tests (loopback only), and a delivery worker to feed it.

``Receiver`` records every POST (body, signature header, when) and answers what its
``answer`` function says (status, JSON, delay), so a test can fail, stall or finish
deliveries; ``verified`` checks a record's signature against the server's JWKS the way
a receiver should (protocol/webhooks.py ``verify``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.protocol.webhooks import verify

from .conftest import terminate

LOOPBACK = "127.0.0.0/8"


@dataclass
class Delivery:
    body: dict[str, Any]
    raw: bytes
    signature: str | None
    at: float = field(default_factory=time.monotonic)


Answer = Callable[[Delivery], tuple[int, Any, float]]  # status, JSON body, seconds to wait first


def finish(_: Delivery) -> tuple[int, Any, float]:
    return 200, {"done": True}, 0.0


def accept(_: Delivery) -> tuple[int, Any, float]:
    return 200, {}, 0.0


class Receiver:
    def __init__(self, answer: Answer = accept) -> None:
        self.answer = answer
        self.received: list[Delivery] = []
        self._arrived = asyncio.Condition()
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        delivery = Delivery(orjson.loads(raw), raw, request.headers.get("Webhook-Signature"))
        async with self._arrived:
            self.received.append(delivery)
            self._arrived.notify_all()
        status, body, wait = self.answer(delivery)
        if wait:
            await asyncio.sleep(wait)
        return web.json_response(body, status=status)

    async def wait_for(self, count: int = 1, timeout: float = 10.0) -> list[Delivery]:
        """At least ``count`` deliveries (all received so far)."""
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: len(self.received) >= count), timeout)
        return list(self.received)

    def for_sub(self, sub: str) -> list[Delivery]:
        return [d for d in self.received if d.body["subscription_id"] == sub]


@contextlib.asynccontextmanager
async def receiver(answer: Answer = accept, path: str = "/hook") -> AsyncIterator[Receiver]:
    box = Receiver(answer)
    app = web.Application()
    app.router.add_post(path, box._handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    box.url = f"http://127.0.0.1:{port}{path}"
    try:
        yield box
    finally:
        await runner.cleanup()


async def verified(http: aiohttp.ClientSession, jwks_url: str, delivery: Delivery) -> bool:
    async with http.get(jwks_url) as response:
        jwks = await response.json(content_type=None)
    return delivery.signature is not None and verify(delivery.signature, delivery.raw, jwks, int(time.time()))


def clean_env() -> dict[str, str]:
    """The environment without DURABLE_STREAMS_* (a developer's settings must not leak in)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_")}


@contextlib.contextmanager
def command(*args: str, log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m gateway <args>`` as its own process (to kill or pause), stopped after
    the block (continued first, if paused)."""
    with open(log, "ab") if log else contextlib.nullcontext() as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args],
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            terminate(proc, 10)


def deliver_worker(
    redis_url: str, *extra: str, cluster: bool = False
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """``durable-streams deliver`` as its own process, loopback webhooks allowed."""
    return command("deliver", "--redis-url", redis_url, "--webhook-allow", LOOPBACK, "--log-level", "warning",
                   *(["--redis-cluster"] if cluster else []), *extra)  # fmt: skip


async def eventually(check: Callable[[], Any], timeout: float = 10.0, every: float = 0.05) -> Any:
    """``await check()`` until it is truthy (its value), or AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not so after {timeout} s: {check}")
        await asyncio.sleep(every)
