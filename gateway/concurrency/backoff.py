"""How long to wait before trying again: exponential, capped, jittered.

Capped so that a process notices a recovered Redis within ``cap`` seconds;
jittered so that the gateways and workers that lost Redis together do not all
knock again in the same instant when it comes back (a thundering herd).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable


def delay(
    attempt: int, first: float = 0.25, cap: float = 10.0, rand: Callable[[], float] = random.random
) -> float:
    """Seconds to wait after the ``attempt``-th failure in a row (0 for the first):
    ``first * 2**attempt``, at most ``cap``, of which a random half is taken off
    ("equal jitter": never less than half the step, so retries still slow down)."""
    step = min(cap, first * 2.0 ** min(attempt, 32))
    return step / 2 + rand() * step / 2


async def pause(seconds: float, wake: asyncio.Event | None = None) -> bool:
    """Wait ``seconds``, or less if ``wake`` is set meanwhile (news that trying again
    now is worth it); whether it was. ``wake`` is left as it is."""
    if wake is None:
        await asyncio.sleep(seconds)
        return False
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await wake.wait()
    return wake.is_set()
