"""What a script's answer or a Redis failure means for the client: the
ProtocolErrors storage raises, and which Redis errors mean "unavailable"."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import redis.exceptions

from ..protocol import offsets, tenants
from ..protocol.conditions import offset_conflict, precondition_failed
from ..protocol.errors import ProtocolError, bad_request
from ..protocol.headers import (
    PRODUCER_EPOCH,
    PRODUCER_EXPECTED_SEQ,
    PRODUCER_RECEIVED_SEQ,
    STREAM_CLOSED,
    STREAM_NEXT_OFFSET,
)
from ..protocol.models import text
from ..protocol.responses import current_state
from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from .contracts import (
    APPEND,
    AppendClosed,
    AppendConflict,
    AppendFailed,
    AppendSeqGap,
    AppendStaleEpoch,
    QuotaRefused,
)

log = logging.getLogger(__name__)
limited = RateLimited(log)
# Redis' answers to a write it will not do now (full, a replica, failing disk, ...):
# nothing was stored, and a retry later may succeed.
_REFUSALS = re.compile(r"\b(OOM|READONLY|MISCONF|NOREPLICAS|MASTERDOWN|BUSY|LOADING)\b")
# An append's own failure (append.lua catches it) in ds_redis_errors_total: by the class
# redis-py raises for the same error on a plain call (a create refused for memory counts
# as OutOfMemoryError too), else ResponseError.
_ERROR_CLASSES = {"OOM": "OutOfMemoryError", "READONLY": "ReadOnlyError", "LOADING": "BusyLoadingError"}
# Errors that mean "Redis is not reachable right now" (as opposed to a bad request).
UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    # Redis Cluster's "not now" from redis-py's cluster client (routing.py turns them into
    # NotSent): a failover under way, a slot moving, redirects without end ("TTL
    # exhausted"). Not RedisClusterException at large: it also means a bug (cross-slot keys).
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.TryAgainError,
)


def outcome_unknown() -> ProtocolError:
    """An append sent to Redis whose answer never came (timeout, connection lost):
    it may or may not be stored. Not 503 + Retry-After: a blind retry could store
    it twice. An idempotent producer's retry is safe (the duplicate is recognized)."""
    return ProtocolError(
        504,
        "outcome unknown: storage did not confirm this append, which may or may not be stored; "
        "retry only with idempotent producer headers (Producer-Id/Epoch/Seq), which make retries safe",
    )


def dropped(floor: int | None = None) -> ProtocolError:
    """A read below what is retained (retention, or an application snapshot above it:
    features/snapshots.py). ``floor``, where retained data starts, is said in the body and
    as ``Stream-Next-Offset``: where to read from instead (or bootstrap, with a snapshot)."""
    if floor is None:
        return ProtocolError(410, "the data at this offset was dropped by the retention policy")
    earliest = offsets.encode(floor)
    message = f"the data at this offset is no longer retained; the earliest offset is {earliest}"
    # Ursula names it Stream-Earliest-Offset; Stream-Next-Offset too: where to read from.
    headers = {"Stream-Earliest-Offset": earliest, "Stream-Next-Offset": earliest}
    return ProtocolError(410, message, headers)


def inherited_gone(fork_point: int | None = None) -> ProtocolError:
    """A weak fork's read of data it inherited from a source that has since been deleted
    (or expired): weak forks do not hold their source (see forks.py)."""
    message = "the data this fork inherited was deleted by its source's owner"
    if fork_point is not None:
        message += f"; the fork's own data, from offset {offsets.encode(fork_point)}, is still readable"
    return ProtocolError(410, message)


def not_found(status: str) -> ProtocolError:
    if status == "gone":
        return ProtocolError(410, "stream was deleted")
    return ProtocolError(404, "stream not found")


# Refusals of an append that depended on where the stream was: the answer says where it is.
_CONFLICTS: dict[str, Callable[[dict[str, str]], ProtocolError]] = {
    "precondition_failed": precondition_failed,  # If-Match: 412
    "offset_conflict": offset_conflict,  # Stream-Expected-Offset: 409
    "seq_regress": lambda state: ProtocolError(409, "Stream-Seq must increase", state),
}


def tenant_refusal(status: str, result: list[Any]) -> ProtocolError:
    """A script's 'quota' or 'foreign' answer (lua/_tenants.lua), as the client's error."""
    if status == "foreign":
        return tenants.foreign()
    refused = QuotaRefused(*result)
    return tenants.refused(text(refused.quota), int(refused.limit), int(refused.usage), int(refused.asked))


def append_error(status: str, result: list[Any], stream_id: str) -> ProtocolError:
    """An append.lua answer other than 'ok' or 'dup', as the client's error."""
    if status == "error":  # append.lua caught a failure of this append alone
        failed = AppendFailed(*result)
        written, message = text(failed.written), text(failed.message)
        refusal = _REFUSALS.search(message)
        error = _ERROR_CLASSES.get(refusal[0], "ResponseError") if refusal else "ResponseError"
        metrics.REDIS_ERRORS.labels(APPEND.name, error).inc()
        if written == "none" and refusal:
            limited.log(logging.WARNING, "refused", "redis refused an append: %s", message)
            reason = f"storage refused the append ({refusal[0]}): not stored"
            return ProtocolError(503, reason, {"Retry-After": "5"})
        limited.log(logging.ERROR, "append", "append failed in Redis (%s written): %s", written, message)
        if written == "none":
            return ProtocolError(500, "internal error: the append was not stored")
        return ProtocolError(500, "internal error: the append may be partly stored")
    if status == "closed":
        return ProtocolError(
            409,
            "stream is closed",
            {STREAM_CLOSED: "true", STREAM_NEXT_OFFSET: offsets.encode(int(AppendClosed(*result).tail))},
        )
    if status == "ct_mismatch":
        return ProtocolError(409, "content type does not match the stream's")
    if status in _CONFLICTS:  # {status, tail, created}: the stream is open; where it is, to retry from
        conflict = AppendConflict(*result)
        state = current_state(stream_id, text(conflict.created), int(conflict.tail), closed=False)
        return _CONFLICTS[status](state)
    if status in ("quota", "foreign"):
        return tenant_refusal(status, result)
    if status == "bad_epoch_seq":
        return bad_request("a new producer epoch must start at Producer-Seq 0")
    if status == "stale_epoch":
        return ProtocolError(
            403, "stale producer epoch", {PRODUCER_EPOCH: text(AppendStaleEpoch(*result).epoch)}
        )
    if status == "seq_gap":
        gap = AppendSeqGap(*result)
        return ProtocolError(
            409,
            "producer sequence gap",
            {PRODUCER_EXPECTED_SEQ: text(gap.expected), PRODUCER_RECEIVED_SEQ: text(gap.received)},
        )
    return not_found(status)
