"""A stream's summary as a backup's manifest keeps it, and the digest of its bytes: the same
functions for the backup (from what it dumped) and for ``verify`` (from a live deployment)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from typing import Any

from ..archive.cold import ColdReader
from ..archive.files import Archive
from ..protocol.errors import ProtocolError
from ..protocol.models import Meta, text
from ..redis_io.scripts import Scripts
from ..streams.reads import Reads
from . import Say

AT_ONCE = 32  # streams read at once


def fields_digest(fields: list[Any] | dict[Any, Any]) -> str:
    """A hash's fields and values (HGETALL's, flat from a script or a dict from redis-py) as
    one SHA-256, in no order of Redis'."""
    flat = [item for pair in fields.items() for item in pair] if isinstance(fields, dict) else fields
    pairs = sorted((text(flat[i]), text(flat[i + 1])) for i in range(0, len(flat), 2))
    joined = "\n".join(f"{k}\t{v}" for k, v in pairs)
    return hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()


def summary(
    meta: Meta, producers: Any, subscriptions: Any, *, deleted: bool = False, expires_ms: int = -1
) -> dict[str, Any]:
    """What a restore must give back of one stream, but its bytes (``content_digest``).
    ``deleted``: soft-deleted (kept for its forks' reads; its own reads answer 410);
    ``expires_ms``: when its keys expire (absolute, -1 never)."""
    return {
        "deleted": deleted,
        "expires_ms": expires_ms,
        "created": meta.created,
        "content_type": meta.content_type,
        "floor": meta.floor,
        "tail": meta.tail,
        "closed": meta.closed,
        "ttl": meta.ttl,
        "expires_at": meta.expires_at,
        "producers": fields_digest(producers),
        "subscriptions": fields_digest(subscriptions),
    }


# A subscription's configuration (sub_create.lua): never changes while it exists. The rest of
# its state hash, its links and its pending set move with every delivery.
SUBSCRIPTION_CONFIG = ("id", "cfg", "hash", "created_at", "type", "ttl", "base", "backfill", "created_ms")


def subscription_summary(state: Any, links: Any, pending: Any) -> dict[str, str]:
    """What a restore must give back of one subscription (its three hashes' fields)."""
    flat = [item for pair in state.items() for item in pair] if isinstance(state, dict) else list(state)
    config = [
        item
        for i in range(0, len(flat), 2)
        if text(flat[i]) in SUBSCRIPTION_CONFIG
        for item in (flat[i], flat[i + 1])
    ]
    return {
        "config": fields_digest(config),
        "state": fields_digest(flat),
        "links": fields_digest(links),
        "pending": fields_digest(pending),
    }


def reader(scripts: Scripts, archive: Archive) -> Reads:
    """Reads as a gateway's, for digests: pages of 1 MiB, no answer size cap."""
    return Reads(scripts, ColdReader(archive, 64 << 20), 1 << 40, 64 * 1024)


class Changed(Exception):
    """The stream is not the one summarised (deleted, or created anew) or lost data meanwhile."""


async def content_digest(
    reads: Reads, sid: str, created: str, start: int, end: int, meta: Meta | None = None
) -> str:
    """SHA-256 of the stream's bytes in ``[start, end)``, wherever they are (its Redis log,
    the archive's files, a fork's ancestors), read as catch-up reads page them; no sliding
    TTL is refreshed. ``meta``: the stream's as last seen (a backup's dump), else looked up.
    Raises ``Changed`` when the stream is not that incarnation any more, or (410) that data
    is gone."""
    digest = hashlib.sha256()
    if meta is None:
        try:
            meta = await reads.head(sid)
        except ProtocolError as exc:
            raise Changed(f"{exc.status}") from None
    if meta.created != created:
        raise Changed("created anew")
    pos = start
    while pos < end:
        try:
            page = await reads.page(meta, pos, end)
        except ProtocolError as exc:
            raise Changed(f"{exc.status}") from None
        for at, data in page:
            if at != pos:
                raise Changed(f"data at {at}, expected {pos}")
            data = data[: end - pos]
            digest.update(data)
            pos += len(data)
            if pos >= end:
                break
    return digest.hexdigest()


async def digest_all(
    reads: Reads, streams: dict[str, dict[str, Any]], metas: dict[str, Meta], say: Say
) -> int:
    """Each stream's content digest (``content``), ``AT_ONCE`` at a time, from the meta it was
    taken with; a soft-deleted one has none, one that changed meanwhile None. Returns how
    many changed."""
    todo: Iterator[tuple[str, dict[str, Any]]] = iter(streams.items())
    changed = 0

    async def worker() -> None:
        nonlocal changed
        for sid, s in todo:
            if s["deleted"]:
                s["content"] = None
                continue
            try:
                s["content"] = await content_digest(
                    reads, sid, s["created"], s["floor"], s["tail"], metas[sid]
                )
            except Changed as exc:
                s["content"] = None
                changed += 1
                say(f"  {sid}: changed while backed up ({exc}): its bytes are not digested")

    await asyncio.gather(*(worker() for _ in range(AT_ONCE)))
    return changed
