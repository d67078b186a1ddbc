"""A large append's parts as plain commands (one Redis only): what an append_part.lua
'part' step does, written in one MULTI/EXEC under WATCH of the stream's meta hash
(``connections.watched_write``), so its data never passes through Lua, which hashes every
string argument whole: ~1.2 ms of Redis per MiB, as much as the rest of writing it.

WATCH gives the same fencing as the script: the part is written only if neither the meta
hash nor the log changed since the fields were read, so a writer gone past PEND_MS, whose
append another one is rolling back (XDELs in the log, then the meta hash), writes nothing;
and the last step commits only if the parts end where the append said they would
(append_part.lua checks pend_to), so a part lost to a failover fails the append.
Anything unusual (the stream gone or expired, the append no longer this writer's, its
time up) is left to the script, which knows what to do about it: ``commands`` returns
None.
"""

from __future__ import annotations

from typing import Any

from ..protocol.entries import LogEntry
from ..protocol.models import text

PEND_MS = 5000  # lua/_prelude.lua's (tests/test_large_appends.py checks they agree)
# The meta fields a part is written from, in this order.
FIELDS = ("pend", "pend_at", "pend_until", "deleted", "exp")


def commands(
    meta: str, log: str, token: str, entries: list[LogEntry], producer: bytes, values: list[Any], now_ms: int
) -> list[tuple[Any, ...]] | None:
    """The part's XADDs to ``log`` (at the append's next positions, as add_entries in
    _prelude.lua writes them: data, time, producer "<epoch> <seq> <id>" or '') and the move
    of pend_at and pend_until in ``meta`` (whose FIELDS ``values`` are); None when the
    script should take this part instead."""
    pend, pend_at, pend_until, deleted, exp = (None if v is None else text(v) for v in values)
    if pend != token or pend_at is None or pend_until is None or deleted is not None:
        return None
    if now_ms >= int(pend_until) or (exp is not None and now_ms >= int(exp)):
        return None  # time is up: the script rolls it back (or drops the stream) and says 'lost'
    now, at = b"%d" % now_ms, int(pend_at)
    out: list[tuple[Any, ...]] = []
    for size, data in entries:
        fields = (b"d", data, b"t", now, b"p", producer) if producer else (b"d", data, b"t", now)
        out.append(("XADD", log, b"%d-1" % at, *fields))
        at += size
    out.append(("HSET", meta, b"pend_at", b"%d" % at, b"pend_until", b"%d" % (now_ms + PEND_MS)))
    return out
