"""Stream-Cursor values for CDN request collapsing (protocol section 10.1).

Time is cut into fixed intervals from a fixed epoch; the cursor is the
interval number. A client cursor at or ahead of the current interval gets a
strictly greater one back (plus random jitter), so cursors never repeat and
cached empty responses cannot loop.
"""

from __future__ import annotations

import random
import re
import time

from .errors import bad_request

EPOCH_SECONDS = 1728432000  # 2024-10-09T00:00:00Z, as the protocol suggests
INTERVAL_SECONDS = 20
_MAX_JITTER_SECONDS = 3600
_CURSOR = re.compile(r"\A[0-9]{1,18}\Z")


def parse_client_cursor(values: list[str]) -> int | None:
    """The ``cursor`` query parameter: an interval number we minted, or absent."""
    if not values:
        return None
    if len(values) > 1 or not _CURSOR.match(values[0]):
        raise bad_request("cursor must be a Stream-Cursor value echoed back")
    return int(values[0])


def current_interval(now: float | None = None) -> int:
    now = time.time() if now is None else now
    return int((now - EPOCH_SECONDS) // INTERVAL_SECONDS)


def response_cursor(client: int | None, now: float | None = None, rng: random.Random | None = None) -> str:
    """The cursor for a live response, given the one the client echoed."""
    current = current_interval(now)
    if client is None or client < current:
        return str(current)
    jitter_seconds = (rng or random).randint(1, _MAX_JITTER_SECONDS)
    return str(client + max(1, jitter_seconds // INTERVAL_SECONDS))
