"""Logging that a flood of bad requests or an outage cannot turn into a flood of lines.

The standard library has no rate limit for log records; this is the smallest
one that serves: a message (by key) is written at most once per interval, and
the next line says how many were held back meanwhile.
"""

from __future__ import annotations

import logging
import time


class RateLimited:
    def __init__(self, logger: logging.Logger, every: float = 10.0) -> None:
        self._log = logger
        self._every = every
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(
        self, level: int, key: str, message: str, *args: object, exc_info: BaseException | None = None
    ) -> None:
        """``logger.log(level, message, *args)``, unless ``key`` was logged less than
        ``every`` seconds ago (then only counted)."""
        if not self._log.isEnabledFor(level):
            return
        now = time.monotonic()
        if now - self._last.get(key, -self._every) < self._every:
            self._held[key] = self._held.get(key, 0) + 1
            return
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            message += f" (and {held} more like it in the last {self._every:g} s)"
        self._log.log(level, message, *args, exc_info=exc_info)


class QuietMalformedRequests(logging.Filter):
    """aiohttp logs every malformed HTTP message (a bad header byte, say) at ERROR
    with a traceback; a client's mistake is worth one INFO line now and then."""

    def __init__(self) -> None:
        super().__init__()
        self._limited = RateLimited(logging.getLogger("durable_streams.http"))

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            first = str(exc.message).strip().splitlines()[0] if exc.message else ""
            self._limited.log(
                logging.INFO, "malformed", "malformed HTTP request answered %s: %s", exc.code, first
            )
            return False
        return True


QUIET_MALFORMED = QuietMalformedRequests()
