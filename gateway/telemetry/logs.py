"""Logging: where lines go and how they look (``--log-format text|json``), and
logging that a flood of bad requests or an outage cannot turn into a flood of lines.

The standard library has no rate limit for log records; ``RateLimited`` is the
smallest one that serves: a message (by key) is written at most once per
interval, and the next line says how many were held back meanwhile.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What every LogRecord has: anything else on a record came as ``extra`` and is a field of its own.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class OneLineError(RuntimeError):
    """An error whose message says everything (a refusal to start, say): logged as one
    line, never with a traceback, and printed as one line by the command line."""


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, message, the
    record's extra fields, and exc (a traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")[:-6] + "Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in record.__dict__.items():
            if name not in _STANDARD and not name.startswith("_") and name not in out:
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        try:
            return orjson.dumps(out, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:  # e.g. an int beyond 64 bits in an extra field: the line, not an error
            return orjson.dumps({k: v if isinstance(v, str) else repr(v) for k, v in out.items()}).decode()


def configure(level: str, fmt: str = "text") -> None:
    """The root logger writes to stderr in ``fmt`` (text or json) from ``level`` up.
    Called once per command; again (gunicorn's hooks) it replaces, not adds."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper())


class OneLine(logging.Filter):
    """A record about a ``OneLineError`` loses its traceback and says the error instead
    (gunicorn logs a worker that fails to start with its traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OneLineError):
            record.msg, record.args = f"{record.getMessage()}: {exc}", ()
            record.exc_info, record.exc_text = None, None
        return True


ONE_LINE = OneLine()


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
