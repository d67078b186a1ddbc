"""Forks: referencing a source, planning what a fork inherits, and releasing a
source when a fork is gone.

A fork pins its source or is weak (``CreateSpec.pin_source``). A pinning fork
(the protocol's semantics; every fork when access control is off: the forker
could write the source) is recorded in the source's forks set
(``ds:{<id>}:forks``, ``keys.stream_keys``): deleted or expired, a source with
pinning forks is only soft-deleted (its URL 410, re-creation 409) until the
last one is gone, whose release collects it, up the chain. A weak fork (the
forker may only read the source, and must not be able to block a path it
cannot write) is recorded nowhere on the source, which is deleted or expires
as if unforked: its path is free at once. What a weak fork inherited from it,
and from any ancestor only it held, is then gone: reads of that range answer
410, never another stream's data; the fork's own data, from its fork point,
stays readable, as do HEAD, appends, close and delete.

Incarnations: a stream that is forked gets a random id once (meta ``uid``, set
by fork_ref.lua); a stream created later at the same path gets another. A
fork records the id of each ancestor it reads from (meta ``chain_uids``, one per
``chain`` range; see ``InheritedRange``) and read_range.lua refuses a range whose
ancestor is gone or has another id. Chains written before incarnations were
have no ``chain_uids`` (LEGACY_INCARNATION: any stream there; their forks all
pin, so it is theirs); a new fork of such a fork stamps those ancestors
(fork_ref.lua 'stamp'). A fork also records its source's id (``src_uid``; and
``weak``): release_fork.lua acts only on that incarnation, so deleting a weak
fork never touches a stream created anew at its source's path.

Creating a fork touches two streams in steps of one stream each (reference the
source with fork_ref.lua, then create the fork with create.lua, by the Store);
deleting one releases its sources up the chain (release_fork.lua), one call
per ancestor. The comments at each step say why an interruption between steps
is harmless.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ..protocol import offsets
from ..protocol.errors import ProtocolError, bad_request
from ..protocol.headers import Expiry, normalize_content_type, parse_expires_at
from ..protocol.models import LEGACY_INCARNATION, CreateSpec, InheritedRange, Meta, text
from ..redis_io import keys
from ..redis_io.contracts import (
    FORK_REF,
    RELEASE_FORK,
    ForkRefArgv,
    ForkReferenced,
    ForkReleased,
    ReleaseForkArgv,
    status_of,
)
from ..redis_io.limits import MAX_FORK_DEPTH, MAX_FORK_SUB_MESSAGES, MAX_SCRIPT_ENTRIES
from ..redis_io.outcomes import dropped
from ..redis_io.scripts import Scripts
from .reads import Reads

# Never a stream's uid (those are hex): the incarnation of an ancestor found gone.
_NO_INCARNATION = "-"


def _new_uid() -> str:
    """An incarnation id (meta 'uid'), given to a stream the first time it is forked."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class ForkPlan:
    """What create.lua records for a fork."""

    source: Meta
    given_offset: str  # Stream-Fork-Offset as the client gave it, encoded ('' none)
    fork_offset: str  # the offset the fork starts from in its source
    base: int  # the fork point: where the fork's own log starts
    chain: list[InheritedRange]
    expiry: Expiry


def _in_compacted_part(floor: int) -> ProtocolError:
    """A fork inside a compacted source's compacted part: its history up to there lost
    versions that later messages replaced, not the stream as it was at that offset
    (docs/compaction.md)."""
    return ProtocolError(
        409,
        "Stream-Fork-Offset falls in the source's compacted part: fork at or after " + offsets.encode(floor),
    )


class Forks:
    def __init__(self, scripts: Scripts, reads: Reads, page_bytes: int) -> None:
        self.scripts = scripts
        self.reads = reads
        self.page_bytes = page_bytes

    async def reference(
        self, sid: str, src: str, pin: bool, fork_offset: str | None = None, tenant: str = ""
    ) -> tuple[Meta, bool]:
        """Step 1: the source's meta (with its incarnation id, given now if it had
        none) and whether this call recorded ``sid`` in its forks. Pinning, the fork
        is recorded in a set, so a retry counts once; if we stop before the fork is
        created the extra record only delays the source's collection (see
        ``release_unless_forked``). Weak, nothing is recorded. A compacted source refuses
        a ``fork_offset`` in its compacted part (409), and another ``tenant``'s source is not
        forked (403), before anything changes."""
        anchor = -1 if fork_offset is None else offsets.decode(fork_offset)
        result = await self.scripts.on_stream(
            FORK_REF.name, src, *ForkRefArgv(sid, "pin" if pin else "weak", _new_uid(), anchor, tenant)
        )
        status = status_of(result)
        if status == "foreign":
            raise ProtocolError(403, "the fork source belongs to another tenant")
        if status == "compacted":
            raise _in_compacted_part(int(result[1]))
        if status == "missing":
            raise ProtocolError(404, "fork source stream not found")
        if status == "gone":
            raise ProtocolError(409, "fork source stream was deleted")
        referenced = ForkReferenced(*result)
        return Meta.parse(src, referenced.meta), text(referenced.added) == "1"

    async def plan(self, spec: CreateSpec, source: Meta) -> ForkPlan:
        """Step 2: check the request against the referenced source and work out what the fork inherits."""
        if spec.content_type is not None and normalize_content_type(spec.content_type) != source.media_type:
            raise ProtocolError(409, "fork content type differs from its source's")
        anchor = source.tail if spec.fork_offset is None else offsets.decode(spec.fork_offset)
        if anchor > source.tail:
            raise bad_request("Stream-Fork-Offset is beyond the source stream's tail")
        if anchor < source.floor:  # below what the source retains (retention, a snapshot)
            raise dropped(source.floor)
        point = anchor
        if spec.fork_sub_offset:
            point = await self._resolve_sub_offset(source, anchor, spec.fork_sub_offset)
        if source.compaction and source.base <= point < source.compacted.fork_floor:
            raise _in_compacted_part(source.compacted.fork_floor)
        # The fork reads [0, point) from its ancestors: the source's own chain
        # cut at the fork point, then the source's own log up to it.
        own: InheritedRange = (source.sid, source.base, point, source.uid or LEGACY_INCARNATION)
        chain = [
            (s, lo, min(hi, point), uid) for s, lo, hi, uid in (*source.chain, own) if lo < min(hi, point)
        ]
        if len(chain) > MAX_FORK_DEPTH:  # a read walks the chain one round trip per ancestor
            raise bad_request(f"a fork may read through at most {MAX_FORK_DEPTH} ancestors")
        chain = [await self._identified(r) for r in chain]
        expiry = spec.expiry
        if expiry == Expiry():  # nothing asked: inherit the source's lifetime
            expiry = Expiry(
                ttl_seconds=source.ttl,
                expires_at=source.expires_at,
                expires_at_ms=None if source.expires_at is None else parse_expires_at(source.expires_at),
            )
        return ForkPlan(
            source=source,
            given_offset="" if spec.fork_offset is None else offsets.encode(anchor),
            fork_offset=offsets.encode(anchor),
            base=point,
            chain=chain,
            expiry=expiry,
        )

    async def _resolve_sub_offset(self, source: Meta, anchor: int, sub: int) -> int:
        """The fork point ``sub`` bytes (or JSON messages) past ``anchor``.

        Bytes may not run past the end of the append that holds the anchor;
        JSON messages may not run past the source's tail.
        """
        segments = (*source.chain, (source.sid, source.base, source.tail, source.uid or LEGACY_INCARNATION))
        if source.is_json:  # counted a page of bounded reads at a time, up to a bound
            if sub > MAX_FORK_SUB_MESSAGES:
                raise bad_request(f"Stream-Fork-Sub-Offset counts at most {MAX_FORK_SUB_MESSAGES} messages")
            pos, left = anchor, sub
            while left:
                page = await self.reads.read_segments(
                    segments, pos, self.page_bytes, True, min(left, MAX_SCRIPT_ENTRIES)
                )
                if not page or page[0][0] != pos:
                    raise bad_request("Stream-Fork-Sub-Offset overshoots the source's messages")
                pos, left = page[-1][0] + len(page[-1][1]), left - len(page)
            return pos
        # One entry, the append holding the anchor, read no further than ``sub`` bytes.
        entries = await self.reads.read_segments(segments, anchor, sub, False, 1)
        if not entries or len(entries[0][1]) < sub:
            raise bad_request("Stream-Fork-Sub-Offset overshoots the data at the fork offset")
        return anchor + sub

    async def _identified(self, inherited: InheritedRange) -> InheritedRange:
        """A chain range with its ancestor's incarnation: for a range of a chain written
        before incarnations were, the stream's now (given one if it has none). The
        source holds its ancestors (such a chain's forks all pin), so it is the same
        stream; gone, the range is unreadable already, and stays so (``_NO_INCARNATION``)."""
        sid, lo, hi, uid = inherited
        if uid != LEGACY_INCARNATION:
            return inherited
        result = await self.scripts.on_stream(FORK_REF.name, sid, *ForkRefArgv("", "stamp", _new_uid()))
        if status_of(result) != "ok":
            return (sid, lo, hi, _NO_INCARNATION)
        return (sid, lo, hi, Meta.parse(sid, ForkReferenced(*result).meta).uid or _NO_INCARNATION)

    async def release_unless_forked(self, sid: str, src: str, uid: str) -> None:
        """Drop the record step 1 added for a fork that did not come to be (or exists
        already, weak or from another incarnation of ``src``): unless ``sid`` is now a
        pinning fork of this incarnation of ``src``, whose record it is as well (a
        concurrent create of the same fork, referencing after us)."""
        meta = keys.stream_keys(sid)[0]
        owner, owner_uid, weak = await self.scripts.command(meta, "HMGET", meta, "src", "src_uid", "weak")
        pinned = (
            owner is not None
            and text(owner) == src
            and (owner_uid is None or text(owner_uid) == uid)
            and weak is None
        )
        if not pinned:
            await self.release(sid, src, uid)

    async def release(self, child: str, src: str, uid: str) -> None:
        """Release ``child``'s hold on ``src`` (the incarnation ``uid``; '' for a fork
        made before incarnations were), collecting up the chain. Harmless for a weak
        fork: it holds nothing, and another incarnation at ``src`` is left alone."""
        while src:
            result = await self.scripts.on_stream(RELEASE_FORK.name, src, *ReleaseForkArgv(child, uid))
            if status_of(result) != "collected":
                return
            released = ForkReleased(*result)
            child, src, uid = src, text(released.source), text(released.source_uid)
