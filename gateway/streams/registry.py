"""The ``__registry__`` stream (``--stream-registry``): a JSON stream of every create and
delete, in the form upstream's reference server writes it (its test UI and tools find
streams by reading it): State Protocol change events,
``{"type": "streams", "key": path, "value": {"path", "contentType", "createdAt"},
"headers": {"operation": "insert"}}`` and ``{..., "headers": {"operation": "delete"}}``.

Best effort, as upstream's lifecycle hooks are: the event is appended after the create
or delete succeeded (on Redis Cluster the registry lives in another slot than the
stream, so one script cannot do both); a gateway that dies between the two, or a
stream that expires, leaves no event. ``GET {prefix}/__ds/streams`` (listing.py) is
the complete, exact answer; the registry is for tools that expect it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from ..protocol.errors import ProtocolError
from ..redis_io import keys
from ..telemetry.logs import RateLimited

log = logging.getLogger(__name__)
limited = RateLimited(log)

REGISTRY_PATH = "__registry__"
REGISTRY_ID = keys.stream_id(REGISTRY_PATH)
JSON = "application/json"


def created_event(path: str, content_type: str, created_ms: int) -> bytes:
    value = {"path": path, "contentType": content_type, "createdAt": created_ms}
    return _event({"type": "streams", "key": path, "value": value, "headers": {"operation": "insert"}})


def deleted_event(path: str) -> bytes:
    return _event({"type": "streams", "key": path, "headers": {"operation": "delete"}})


def _event(body: dict[str, object]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


class Registry:
    """Appends lifecycle events to ``__registry__`` when ``enabled`` (made on first use).
    ``create(sid)`` makes the registry stream (idempotent), ``append(sid, event)`` appends."""

    def __init__(
        self,
        create: Callable[[str], Awaitable[object]],
        append: Callable[[str, bytes], Awaitable[object]],
        *,
        enabled: bool = False,
    ) -> None:
        self.enabled = enabled
        self._create, self._append = create, append
        self._made = False

    async def record(self, sid: str, event: Callable[[], bytes]) -> None:
        """Append ``event()`` for stream ``sid`` (not for the registry itself); a failure
        is logged, never the caller's (its create or delete already happened)."""
        if not self.enabled or sid == REGISTRY_ID:
            return
        try:
            if not self._made:
                await self._create(REGISTRY_ID)
                self._made = True
            try:
                await self._append(REGISTRY_ID, event())
            except ProtocolError as exc:
                if exc.status not in (404, 410):
                    raise
                await self._create(REGISTRY_ID)  # someone deleted it: made again, this event first
                await self._append(REGISTRY_ID, event())
        except Exception as exc:  # closed or made otherwise by someone, Redis away...
            limited.log(logging.WARNING, "registry", "__registry__ event not recorded: %s", exc)
