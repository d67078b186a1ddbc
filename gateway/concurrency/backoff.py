"""How long to wait before trying again: exponential, capped, jittered.

Capped so that a process notices a recovered Redis within ``cap`` seconds;
jittered so that the gateways and workers that lost Redis together do not all
knock again in the same instant when it comes back (a thundering herd).
"""

from __future__ import annotations

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
