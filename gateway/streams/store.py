"""The Store: every stream operation the HTTP handlers call, on Redis.

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
This module builds the parts above and holds create and delete; appends and
reads are passed on to their modules.
"""

from __future__ import annotations

import json

from ..archive.cold import ColdReader
from ..features.buckets import Buckets
from ..features.hints import Hints
from ..features.listing import IndexSweep, Listing
from ..features.snapshots import Snapshots
from ..features.subscriptions import Subscriptions
from ..protocol.conditions import precondition_failed
from ..protocol.entries import flatten, pack_messages
from ..protocol.errors import ProtocolError
from ..protocol.headers import DEFAULT_CONTENT_TYPE, Expiry, normalize_content_type
from ..protocol.models import CreateSpec, Meta, text
from ..protocol.responses import current_state
from ..redis_io import keys
from ..redis_io.outcomes import not_found
from ..redis_io.scripts import Scripts
from .appends import Appends
from .forks import ForkPlan, Forks
from .reads import Reads
from .registry import JSON, Registry, created_event, deleted_event


class Store:
    def __init__(
        self,
        scripts: Scripts,
        cold: ColdReader,
        max_chunk_bytes: int,
        notice_payload_bytes: int = 8192,
        read_inline_bytes: int = 64 * 1024,
    ) -> None:
        self.scripts = scripts
        self.redis = redis = scripts.redis
        self.hints = Hints(redis)
        self.reads = Reads(scripts, cold, max_chunk_bytes, read_inline_bytes)
        self.appends = Appends(self.scripts, self.hints, notice_payload_bytes)
        self.forks = Forks(self.scripts, self.reads, max_chunk_bytes)
        self.subscriptions = Subscriptions(scripts)
        self.listing = Listing(scripts)
        self.index_sweep = IndexSweep(self.listing)
        self.buckets = Buckets(self.listing)
        self.snapshots = Snapshots(scripts, cold.archive)
        self.registry = Registry(self._make_registry, self._registry_append)
        if scripts.cluster:
            keys.subs_outbox(
                "", cluster=True
            )  # its table of slot tags, now (~0.5 s) rather than at an append
        # Appends and reads are the collaborators' own methods, bound here: no wrapper that
        # repeats their signatures and costs every request a coroutine (see appends.py, reads.py).
        self.append = self.appends.append
        self.head = self.reads.head
        self.read = self.reads.read
        self.read_shared = self.reads.read_shared

    # -- create, delete -------------------------------------------------------

    async def create(self, sid: str, spec: CreateSpec) -> tuple[bool, Meta]:
        """PUT: (created, meta). 409 for an existing stream configured otherwise."""
        if spec.fork_from is None:
            content_type = spec.content_type or DEFAULT_CONTENT_TYPE
            return await self._create(
                sid, spec, content_type, normalize_content_type(content_type), spec.expiry, fork=None
            )
        src = spec.fork_from
        source, added = await self.forks.reference(sid, src, spec.pin_source)
        # Only a record this call added is dropped below: an existing one is the fork's
        # (or a concurrent create's) own, and a weak reference records nothing.
        uid = source.uid or ""
        try:
            plan = await self.forks.plan(spec, source)
            created, meta = await self._create(
                sid, spec, source.content_type, source.media_type, plan.expiry, plan
            )
        except ProtocolError:
            if added:
                await self.forks.release_unless_forked(sid, src, uid)
            raise
        if added and not created:  # it existed: the record stays only if it is a pinning fork of this source
            await self.forks.release_unless_forked(sid, src, uid)
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
        script_keys = self.keys_with_subscribers(sid)
        record = await self.subscriptions.workers.alive()
        result = await self.scripts.run(
            "create",
            script_keys,
            [
                content_type,
                media_type,
                "" if expiry.ttl_seconds is None else expiry.ttl_seconds,
                "" if expiry.expires_at_ms is None else expiry.expires_at_ms,
                expiry.expires_at or "",
                "1" if spec.closed else "0",
                fork.source.sid if fork else "",
                fork.given_offset if fork else "",
                fork.fork_offset if fork else "",
                spec.fork_sub_offset,
                fork.base if fork else 0,
                json.dumps([[s, lo, hi] for s, lo, hi, _ in fork.chain] if fork else []),
                json.dumps([uid for _, _, _, uid in fork.chain] if fork else []),
                (fork.source.uid or "") if fork else "",
                "1" if fork and not spec.pin_source else "0",
                "1" if record else "0",
                keys.SUBS_WAKE_CHANNEL,
                spec.if_match,
                *flatten(spec.entries),
            ],
        )
        status = text(result[0])
        if status == "conflict":
            raise ProtocolError(409, "stream exists with a different configuration")
        if status == "precondition_failed":
            tail, incarnation = text(result[1]), text(result[2])
            state = current_state(sid, incarnation, int(tail), False) if tail else {}
            raise precondition_failed(state)
        meta = Meta.parse(sid, result[1])
        if status == "created":
            if spec.entries:
                self.hints.mark(sid)
            path = keys.path_of(sid)
            await self.registry.record(sid, lambda: created_event(path, meta.content_type, int(meta.created)))
        return status == "created", meta

    def keys_with_subscribers(self, sid: str) -> list[str]:
        """A stream's keys, its subscription links, its slot's stream index and outbox
        (create.lua, delete.lua)."""
        cluster = self.scripts.cluster
        return [
            *keys.stream_keys(sid),
            keys.stream_subs(sid),
            keys.stream_index(sid, cluster),
            keys.subs_outbox(sid, cluster),
        ]

    async def delete(self, sid: str) -> None:
        result = await self.scripts.run("delete", self.keys_with_subscribers(sid), [keys.SUBS_WAKE_CHANNEL])
        status = text(result[0])
        if status in ("missing", "gone"):
            raise not_found(status)
        await self.registry.record(sid, lambda: deleted_event(keys.path_of(sid)))
        if status == "deleted":
            await self.hints.forget(sid)
            await self.forks.release(sid, text(result[1]), text(result[2]))
            if len(result) > 3 and text(result[3]):
                await self.snapshots.forget(text(result[3]))
