"""What gateways serve each tenant (docs/tenants.md, "Usage"): requests by kind and bytes
out, counted in the process and added to the hour's meter hash (``keys.meter``, the hash
the write scripts count appends and bytes in to) every FLUSH_SECONDS, one pipeline of
HINCRBY, and at shutdown. A process killed outright loses at most its last
FLUSH_SECONDS of these counts; what writes store is counted by their scripts, exactly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from ..concurrency.cancelling import raise_if_cancelled
from ..redis_io import keys
from ..redis_io.scripts import Scripts
from ..telemetry import metrics
from ..telemetry.logs import RateLimited

log = logging.getLogger(__name__)
limited = RateLimited(log)
FLUSH_SECONDS = 1.0
# A request's kind, by method and live mode: the meter's 'requests_<kind>' counters.
KINDS = {"PUT": "create", "POST": "append", "DELETE": "delete", "HEAD": "head", "GET": "read"}


def request_kind(method: str, live: str | None) -> str:
    """The kind a stream request is counted as (``live``: its ``live`` query parameter)."""
    if method == "GET" and live in ("sse", "long-poll"):
        return live.replace("-", "_")
    return KINDS.get(method, "other")


class UsageMeter:
    def __init__(self, scripts: Scripts, labelled: int = 50) -> None:
        self.redis = scripts.redis
        self.counts: Counter[str] = Counter()  # '<tenant> <counter>' -> count since the last flush
        self.labelled: set[str] = set()  # tenants with a label of their own in /metrics
        self.most_labelled = labelled
        # (tenant, kind) -> its meter fields and /metrics children, made once
        self._children: dict[tuple[str, str], tuple[str, str, Any, Any]] = {}

    def request(self, tenant: str, kind: str, bytes_out: int) -> None:
        """One request of ``tenant`` answered, with ``bytes_out`` body bytes sent."""
        children = self._children.get((tenant, kind))
        if children is None:  # (labels() takes a lock and builds a tuple: once per tenant and kind)
            if len(self._children) >= 4 * (self.most_labelled + 1) * len(KINDS):
                self._children.clear()
            label = self._label(tenant)
            children = self._children[(tenant, kind)] = (
                f"{tenant} requests_{kind}",
                f"{tenant} bytes_out",
                metrics.TENANT_REQUESTS.labels(label, kind),
                metrics.TENANT_BYTES_OUT.labels(label),
            )
        requests_field, bytes_field, requests, sent = children
        self.counts[requests_field] += 1
        requests.inc()
        if bytes_out:
            self.counts[bytes_field] += bytes_out
            sent.inc(bytes_out)

    def _label(self, tenant: str) -> str:
        """The tenant's label in /metrics: its name while fewer than the cap have one, else
        'other' (a label, once given, stays: the counters stay monotonic)."""
        if tenant in self.labelled:
            return tenant
        if len(self.labelled) < self.most_labelled:
            self.labelled.add(tenant)
            return tenant
        return "other"

    async def flush(self) -> None:
        """The counts so far, added to this hour's meter; kept for the next try if Redis fails."""
        if not self.counts:
            return
        counts, self.counts = self.counts, Counter()
        key = keys.meter(keys.meter_hour(time.time()))
        pipe = self.redis.pipeline(transaction=True)  # all of them or none
        for field, n in counts.items():
            pipe.hincrby(key, field, n)
        try:
            await pipe.execute()
        except BaseException:
            self.counts.update(counts)  # (counted twice if the EXEC ran and only its reply was lost)
            raise

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(FLUSH_SECONDS)
                try:
                    await self.flush()
                except Exception as exc:  # Redis away: the next round tries again
                    raise_if_cancelled()
                    limited.log(logging.WARNING, "usage", "tenant usage not counted yet: %s", exc)
                raise_if_cancelled()  # (redis-py may answer with the cancellation lost: fleet.py's keep)
        finally:  # stopping: what is counted goes out, if Redis answers in time
            try:
                await asyncio.wait_for(self.flush(), 2.0)
            except Exception as exc:
                limited.log(logging.WARNING, "usage", "tenant usage lost at shutdown: %s", exc)
