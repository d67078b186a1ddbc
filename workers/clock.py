"""The workers' one clock: Unix time in milliseconds, the unit Redis keys and scripts use
(hint scores, outbox entries, wake deadlines)."""

import time


def now_ms() -> int:
    return int(time.time() * 1000)
