"""The Store: the stream operations the HTTP handlers call, on Redis, and the side
features' state beside them.

Most operations are one script call on one stream's keys (one hash tag, see
keys.py), so each runs on the one Redis Cluster node serving the stream. The
exceptions:
- appends go to Redis in batches (``appends.py``): one append.lua call may
  carry appends to several streams of one hash slot (a batch is split by slot);
- a read below the Redis log finds its archived segment after the script, and
  a large read of a byte stream fetches its data after the script, with a MULTI
  of plain XRANGE on the same stream (``reads.py``);
- fork creation, fork deletion and reads of a fork's inherited range are
  sequences of single-stream steps (``forks.py``, ``reads.py``): a fork and its
  source may be on different nodes; the comments at each step say why an
  interruption between steps is harmless.
This module builds the parts above and holds create and delete; the other verbs are
the parts' own methods. The side features are their own objects (features/), built here
and reached as ``store.buckets.create(...)``, ``store.subscriptions.claim(...)``.
"""

from __future__ import annotations

import asyncio
import json
import time

from ..archive.cold import ColdReader
from ..features.buckets import Buckets
from ..features.hints import Hints
from ..features.listing import IndexSweep, Listing
from ..features.snapshots import Snapshots
from ..features.stats import Reader
from ..features.subscriptions import Subscriptions
from ..features.tenant_live import LiveLeases
from ..features.tenants import Tenants
from ..features.usage import UsageMeter
from ..protocol import compaction
from ..protocol.conditions import precondition_failed
from ..protocol.entries import flatten, pack_messages
from ..protocol.errors import ProtocolError
from ..protocol.headers import DEFAULT_CONTENT_TYPE, Expiry, normalize_content_type
from ..protocol.models import CreateSpec, Meta, text
from ..protocol.responses import current_state
from ..redis_io import keys
from ..redis_io.contracts import (
    CREATE,
    DELETE,
    CreateArgv,
    CreateDone,
    CreateRefused,
    DeleteArgv,
    Deleted,
    status_of,
)
from ..redis_io.outcomes import not_found, tenant_refusal
from ..redis_io.scripts import Scripts
from .appends import Appends
from .forks import ForkPlan, Forks
from .reads import Reads
from .registry import JSON, Registry, created_event, deleted_event


class Store:
    """The facade: every stream operation the HTTP handlers ask of Redis, as a verb, and
    the side features' state as objects of their own (``buckets``, ``listing``,
    ``snapshots``, ``subscriptions``, ``stats``). The stream's parts (appends, reads,
    forks, hints, the registry) are private; what every part needs is given at
    construction and never changed after.

    Verbs that are a part's own method are bound here, not wrapped: a wrapper would repeat
    the signature and cost every request one more coroutine (see appends.py, reads.py)."""

    def __init__(
        self,
        scripts: Scripts,
        cold: ColdReader,
        max_chunk_bytes: int,
        notice_payload_bytes: int = 8192,
        read_inline_bytes: int = 64 * 1024,
        read_page_bytes: int = 1024 * 1024,
        *,
        archive_hints: bool = True,
        stream_registry: bool = False,
        compaction_prefixes: tuple[str, ...] = (),
        tenants: bool = False,
        tenant_metrics_top: int = 50,
    ) -> None:
        self._scripts = scripts
        self._compaction_prefixes = compaction_prefixes  # --compaction-prefixes (docs/compaction.md)
        self._hints = Hints(scripts.redis, enabled=archive_hints)
        self._reads = Reads(scripts, cold, max_chunk_bytes, read_inline_bytes, read_page_bytes)
        self._appends = Appends(scripts, self._hints, notice_payload_bytes)
        self._forks = Forks(scripts, self._reads, self._reads.page_bytes)
        self._registry = Registry(self._make_registry, self._registry_append, enabled=stream_registry)
        # The side features: the stream index (one stream as listed, a page of paths, its
        # parts), Ursula's buckets and snapshots, subscriptions and webhook signing, the
        # console's live statistics.
        self.listing = Listing(scripts)
        self.buckets = Buckets(self.listing)
        self.snapshots = Snapshots(scripts, cold.archive)
        self.subscriptions = Subscriptions(scripts)
        self.stats = Reader(scripts)
        self.tenants = Tenants(scripts, cold.archive)
        self.tenant_live = LiveLeases(scripts)
        self.usage = UsageMeter(scripts, tenant_metrics_top)
        self._tenants_on = tenants  # --tenants: their sweep runs here
        self._index_sweep = IndexSweep(self.listing)
        self._hints_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self._tenant_task: asyncio.Task[None] | None = None
        self._live_task: asyncio.Task[None] | None = None
        self._usage_task: asyncio.Task[None] | None = None
        if scripts.cluster:  # the outbox's table of slot tags, now (~0.5 s) rather than at an append
            keys.subs_outbox("", cluster=True)

        # Streams (create and delete are below).
        self.append = self._appends.append
        self.head = self._reads.head
        self.read = self._reads.read
        self.read_shared = self._reads.read_shared
        self.catch_up = self._reads.catch_up  # a catch-up answer: its first page, and where it ends
        self.page = self._reads.page  # the next page of a streamed answer
        self.page_bytes = self._reads.page_bytes
        # Operations: whether Redis answers with the scripts loaded (/readyz).
        self.check_ready = scripts.ready

    def start(self) -> None:
        """The background work: archive hints sent each second, the stream index swept."""
        self._hints_task = asyncio.create_task(self._hints.run(), name="archive hints")
        self._sweep_task = asyncio.create_task(self._index_sweep.run(), name="index sweep")
        if self._tenants_on:
            self._tenant_task = asyncio.create_task(self.tenants.run(), name="tenant sweep")
            self._live_task = asyncio.create_task(self.tenant_live.run(), name="tenant live leases")
            self._usage_task = asyncio.create_task(self.usage.run(), name="tenant usage")

    async def close(self, step_seconds: float = 5.0) -> None:
        """Stop the background work (the hints still marked are sent; the sweep just stops)
        and close the clients; each of the two steps bounded, so that a Redis that does not
        answer cannot hold the process."""
        self._hints.stop()
        for sweep in (self._sweep_task, self._tenant_task, self._live_task, self._usage_task):
            if sweep is not None:
                sweep.cancel()
        tasks = (self._hints_task, self._sweep_task, self._tenant_task, self._live_task, self._usage_task)
        running = [t for t in tasks if t is not None]
        if running:
            _, late = await asyncio.wait(running, timeout=step_seconds)
            for task in late:  # hints Redis did not take in time: dropped (a worker finds them anyway)
                task.cancel()
        await asyncio.wait_for(self._scripts.aclose(), step_seconds)

    # -- create, delete -------------------------------------------------------

    async def create(self, sid: str, spec: CreateSpec) -> tuple[bool, Meta]:
        """PUT: (created, meta). 409 for an existing stream configured otherwise."""
        if spec.fork_from is None:
            content_type = spec.content_type or DEFAULT_CONTENT_TYPE
            return await self._create(
                sid, spec, content_type, normalize_content_type(content_type), spec.expiry, fork=None
            )
        src = spec.fork_from
        source, added = await self._forks.reference(sid, src, spec.pin_source, spec.fork_offset, spec.tenant)
        # Only a record this call added is dropped below: an existing one is the fork's
        # (or a concurrent create's) own, and a weak reference records nothing.
        uid = source.uid or ""
        try:
            plan = await self._forks.plan(spec, source)
            created, meta = await self._create(
                sid, spec, source.content_type, source.media_type, plan.expiry, plan
            )
        except ProtocolError:
            if added:
                await self._forks.release_unless_forked(sid, src, uid)
            raise
        if added and not created:  # it existed: the record stays only if it is a pinning fork of this source
            await self._forks.release_unless_forked(sid, src, uid)
        return created, meta

    async def _make_registry(self, sid: str) -> None:
        try:
            await self.create(sid, CreateSpec(content_type=JSON))
        except ProtocolError:  # made otherwise by someone: its appends fail, and say so
            pass

    async def _registry_append(self, sid: str, event: bytes) -> None:
        await self.append(sid, JSON, pack_messages([event]), close=False, stream_seq=None, producer=None)

    async def _create(
        self,
        sid: str,
        spec: CreateSpec,
        content_type: str,
        media_type: str,
        expiry: Expiry,
        fork: ForkPlan | None,
    ) -> tuple[bool, Meta]:
        born = keys.stream_born(sid)
        script_keys = self.keys_with_subscribers(sid, born, *self._tenant_keys(spec.tenant))
        record = await self.subscriptions.workers.alive()
        argv = CreateArgv(
            content_type=content_type,
            media_type=media_type,
            ttl_seconds="" if expiry.ttl_seconds is None else expiry.ttl_seconds,
            expires_at_ms="" if expiry.expires_at_ms is None else expiry.expires_at_ms,
            expires_at=expiry.expires_at or "",
            closed="1" if spec.closed else "0",
            fork_source=fork.source.sid if fork else "",
            given_offset=fork.given_offset if fork else "",
            fork_offset=fork.fork_offset if fork else "",
            fork_sub_offset=spec.fork_sub_offset,
            base=fork.base if fork else 0,
            chain=json.dumps([[s, lo, hi] for s, lo, hi, _ in fork.chain] if fork else []),
            chain_uids=json.dumps([uid for _, _, _, uid in fork.chain] if fork else []),
            source_uid=(fork.source.uid or "") if fork else "",
            weak="1" if fork and not spec.pin_source else "0",
            workers_alive="1" if record else "0",
            wake_channel=keys.SUBS_WAKE_CHANNEL,
            if_match=spec.if_match,
            compaction_asked="0" if spec.compaction is None else "1",
            gaps="1" if fork and fork.source.gapped else "0",
            compaction=compaction.mode(
                spec.compaction, media_type, keys.path_of(sid), self._compaction_prefixes
            ),
            tenant=spec.tenant,
        )
        result = await self._scripts.run(CREATE.name, script_keys, [*argv, *flatten(spec.entries)])
        status = status_of(result)
        if status == "conflict":
            raise ProtocolError(409, "stream exists with a different configuration")
        if status in ("quota", "foreign"):
            raise tenant_refusal(status, result)
        if status == "precondition_failed":
            refused = CreateRefused(*result)
            tail, incarnation = text(refused.tail), text(refused.created)
            state = current_state(sid, incarnation, int(tail), False) if tail else {}
            raise precondition_failed(state)
        meta = Meta.parse(sid, CreateDone(*result).meta)
        if status == "created":
            if spec.entries:
                self._hints.mark(sid)
            path = keys.path_of(sid)
            await self._registry.record(
                sid, lambda: created_event(path, meta.content_type, int(meta.created))
            )
        return status == "created", meta

    def keys_with_subscribers(self, sid: str, *more: str) -> list[str]:
        """A stream's keys, its subscription links, its slot's stream index, ``more``
        (create.lua: keys.stream_born), and its slot's outbox, last (the prelude's
        OUTBOX) (create.lua, delete.lua)."""
        cluster = self._scripts.cluster
        return [
            *keys.stream_keys(sid),
            keys.stream_subs(sid),
            keys.stream_index(sid, cluster),
            *more,
            keys.subs_outbox(sid, cluster),
        ]

    @staticmethod
    def _tenant_keys(tenant: str) -> list[str]:
        """A call's tenant keys (lua/_tenants.lua), none for a call made for no tenant."""
        return keys.tenant_keys(tenant, time.time()) if tenant else []

    async def delete(self, sid: str, tenant: str = "") -> None:
        """DELETE; ``tenant``: whose stream it must be (docs/tenants.md), '' any."""
        script_keys = self.keys_with_subscribers(sid, *self._tenant_keys(tenant))
        argv = DeleteArgv(keys.SUBS_WAKE_CHANNEL, tenant)
        result = await self._scripts.run(DELETE.name, script_keys, [*argv])
        status = status_of(result)
        if status == "foreign":
            raise tenant_refusal(status, result)
        if status in ("missing", "gone"):
            raise not_found(status)
        await self._registry.record(sid, lambda: deleted_event(keys.path_of(sid)))
        if status == "deleted":
            await self._hints.forget(sid)
            deleted = Deleted(*result)
            await self._forks.release(sid, text(deleted.source), text(deleted.source_uid))
            if text(deleted.snapshot_file):
                await self.snapshots.forget(text(deleted.snapshot_file))
